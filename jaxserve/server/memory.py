"""Giving freed heap memory back to the OS. glibc keeps what a burst of requests freed (large bodies, tokenizer
buffers, one arena per thread that ever allocated) in its arenas, so a server's RSS ratchets up with each burst
though nothing is in use; malloc_trim(0) returns the free pages. A no-op where the C library is not glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def release_free_memory() -> bool:
    """Return the C heap's free pages to the OS; False where that is not possible here."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
