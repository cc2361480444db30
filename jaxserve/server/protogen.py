"""Generate the gRPC Python stubs from protos/ with grpcio-tools.

The build runs this (setup.py, before collecting the package), so the stubs always match the installed
grpcio-tools and the .proto files; tests/server/test_protos.py regenerates them and fails if the installed ones differ.
Loaded by file path from setup.py, so it imports nothing from jaxserve.
"""

from __future__ import annotations

import pathlib
import tempfile

PACKAGE_DIR = "jaxserve/server/proto"  # where the stubs live, relative to the repository root
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(repo_root: pathlib.Path, out_root: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs of every repo_root/protos/*.proto under out_root/PACKAGE_DIR; returns their paths."""
    import importlib.resources

    from grpc_tools import protoc

    protos = sorted((repo_root / "protos").glob("*.proto"))
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    # Mapping protos/ onto the package path makes the generated imports `from jaxserve.server.proto import ...`.
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PACKAGE_DIR}={repo_root / 'protos'}",
        f"--proto_path={well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *map(str, protos),
    ]
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {[p.name for p in protos]}")
    return sorted(out_root / PACKAGE_DIR / f"{p.stem}{s}" for p in protos for s in SUFFIXES)


def stale(repo_root: pathlib.Path) -> list[str]:
    """Names of the stubs in the source tree that differ from freshly generated ones (or are missing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(repo_root, pathlib.Path(tmp))
        return [
            f.name
            for f in fresh
            if not (repo_root / PACKAGE_DIR / f.name).exists()
            or (repo_root / PACKAGE_DIR / f.name).read_bytes() != f.read_bytes()
        ]
