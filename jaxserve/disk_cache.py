"""What jaxserve keeps on disk is a cache: validated when read, rebuilt when bad, skipped when it cannot be written.

A cached folder (the converted weights) ends with a manifest, written last and atomically: every file's size and
CRC-32. A folder whose manifest is missing or disagrees with its files, and a cached file that does not parse,
is moved aside (kept for a post-mortem, named `<name>.bad-<time>-<random>`), logged with its path, and rebuilt from the
source. A cache that cannot be written (a full disk, a read-only folder) is logged and skipped: what was built
serves from memory. No jax: plain files.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import time
import uuid
import zlib
from typing import Callable, TypeVar

from absl import logging

MANIFEST = "manifest.json"
_CHUNK = 1 << 24

T = TypeVar("T")


def crc32(path: pathlib.Path) -> int:
    """The file's CRC-32 (a check against damage, not against tampering: ~1 GB/s)."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: pathlib.Path) -> None:
    """Seal a folder whose files are all written: its manifest, atomically, last."""
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "crc32": crc32(p)} for p in _files(folder)}
    write_text(folder / MANIFEST, json.dumps({"files": entries}, indent=1))


def check_manifest(folder: pathlib.Path) -> str | None:
    """Why the sealed folder is not whole (None: every file is as its manifest says, and no other is there)."""
    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "it has no manifest (a write that never finished)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({e})"
    if not isinstance(entries, dict):
        return "its manifest is unreadable"
    present = {str(p.relative_to(folder)) for p in _files(folder)}
    if present != set(entries):
        return f"its files differ from its manifest's: {sorted(present ^ set(entries))[:3]}"
    for name, want in entries.items():
        path = folder / name
        if path.stat().st_size != want.get("size"):
            return f"{path} has {path.stat().st_size} bytes, its manifest {want.get('size')}"
        if crc32(path) != want.get("crc32"):
            return f"{path} is damaged (its CRC-32 differs from its manifest's)"
    return None


def move_aside(path: pathlib.Path, why: str) -> None:
    """A bad cache entry out of the way (kept beside it), logged with its path and the cause."""
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(aside)
        logging.warning("cache %s is bad (%s): moved to %s, rebuilding it", path, why, aside)
    except OSError as e:
        logging.warning("cache %s is bad (%s) and cannot be moved aside (%s): rebuilding it", path, why, e)
        remove(path)


def remove(path: pathlib.Path) -> None:
    """A cache entry gone, if it can be (a path that cannot be a file, under one, is gone already)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def write_text(path: pathlib.Path, text: str) -> bool:
    """Write a cache file atomically (a temporary file renamed over it). False, logged, if it cannot be written."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError as e:
        logging.warning("cannot write the cache file %s (%s): serving without it", path, e)
        if tmp is not None:
            pathlib.Path(tmp).unlink(missing_ok=True)
        return False


def read_file(path: pathlib.Path, read: Callable[[], T]) -> T | None:
    """A cached file's content by `read`, or None where there is none: absent, or bad (moved aside)."""
    if not path.exists():
        return None
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - whatever a damaged file makes the parser raise, the cache is rebuilt
        move_aside(path, f"{type(e).__name__}: {str(e)[:200]}")
        return None
