"""jaxserve's C++ kernels on a CPU (XLA FFI calls): compiled on first use against jaxlib's FFI headers, cached,
registered, then checked against their reference (pallas_kernels/cpu_attention.py, models/ggml.py).

A build is cached under the cache folder's kernels/, one file per source, headers, flags, jaxlib, compiler, this
CPU (built for its instruction sets) and any library it links; a file that does not load is built again."""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence

import jax
import jaxlib
from absl import logging

HERE = pathlib.Path(__file__).parent
HEADERS = (HERE / "cpu_threads.h",)  # included by every kernel
# for this CPU's instruction sets; -fopenmp-simd: `omp simd` loops (reductions in vector lanes), no OpenMP runtime
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")


class BuildError(RuntimeError):
    """A kernel that could not be compiled here (no working compiler, or it refused the source)."""


def compiler() -> str | None:
    """The C++ compiler ($CXX, else g++), None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def builds(load: Callable[[], None], instead: str) -> bool:
    """Whether `load` (a kernel's: build, register, check) succeeds here. Without a compiler, or with one that
    cannot build the kernel (BuildError), False, with a warning saying what runs `instead`; a build that disagrees
    with its reference raises."""
    if compiler() is None:
        return False
    try:
        load()
    except BuildError as e:
        logging.warning("%s: %s", instead, e)
        return False
    return True


def _cpu() -> str:
    """This CPU's model and instruction sets, as /proc/cpuinfo lists them (a build is -march=native)."""
    info = pathlib.Path("/proc/cpuinfo")
    if not info.is_file():
        return platform.processor()
    lines = info.read_text().splitlines()
    return "|".join(next((x for x in lines if x.startswith(key)), "") for key in ("model name", "flags"))


def build(source: pathlib.Path, libs: Sequence[pathlib.Path] = ()) -> pathlib.Path:
    """`source` compiled into a shared library (linked to `libs`), from the cache or afresh."""
    cxx = compiler()
    if cxx is None:
        raise BuildError(f"{source.name} needs a C++ compiler ($CXX or g++)")
    from jaxserve.models import registry  # the cache folder (models/ imports this package)

    asked = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    if asked.returncode:
        raise BuildError(f"{cxx} --version failed: is it a C++ compiler?")
    version = asked.stdout
    linked = [f"{lib.resolve()}:{lib.stat().st_size}:{lib.stat().st_mtime_ns}" for lib in libs]
    ident = "|".join(
        [*(p.read_text() for p in (source, *HEADERS)), *FLAGS, jaxlib.__version__, version, _cpu(), *linked]
    )
    out = registry.cache_dir() / "kernels" / f"{source.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = pathlib.Path(tmp) / out.name
        command = [
            cxx,
            *FLAGS,
            f"-I{jax.ffi.include_dir()}",
            f"-I{HERE}",
            str(source),
            "-o",
            str(part),
        ]
        for lib in libs:  # lib<name>.so -> -l<name>, found beside it at run time too
            command += [f"-L{lib.parent}", f"-l{lib.name.removeprefix('lib').removesuffix('.so')}"]
            command += [f"-Wl,-rpath,{lib.parent}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise BuildError(f"compiling {source.name} failed:\n{done.stderr[-2000:]}")
        part.replace(out)  # whole or not at all: a concurrent start finds either no file or this one
    return out


def load(
    source: pathlib.Path,
    targets: Sequence[str],
    check: Callable[[], None],
    libs: Sequence[pathlib.Path] = (),
    init: str | None = None,
) -> None:
    """`source` built (or found) and loaded, `init` (a function of no arguments it exports) called, its FFI
    `targets` registered for the CPU, then `check`ed against its reference. A build that fails its check is removed,
    so that the next start compiles it again, and the AssertionError raised as a RuntimeError naming it."""
    path = build(source, libs)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # a damaged file where the build belongs: build it again
        path.unlink()
        lib = ctypes.CDLL(str(build(source, libs)))
    if init is not None:
        getattr(lib, init)()
    for name in targets:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    try:
        with jax.ensure_compile_time_eval():  # the first call may come while a program traces
            check()
    except AssertionError as e:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"{path}: {source.name}'s kernels disagree with their reference ({e}); removed") from e
