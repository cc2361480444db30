"""Sequence layouts over an SP group: which tokens each device holds.

A layout is a permutation `perm` of a chunk's token indices: device j holds tokens perm[j*n/p:(j+1)*n/p].
- contiguous: device j holds one contiguous block;
- striped: device j holds tokens j, j+p, j+2p, ... (round-robin);
- zigzag: the chunk is cut into 2p blocks and device j holds blocks j and 2p-1-j, so every device does the
  same causal attention work (Tetris / ring-attention load balance).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Layout = Literal["contiguous", "striped", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "striped", "zigzag")


def permutation(n: int, p: int, layout: Layout) -> np.ndarray:
    """Token order: position i of the result is the chunk index of the i-th token in device-major order."""
    quantum = 2 * p if layout == "zigzag" else p
    if n % quantum:
        raise ValueError(f"a {layout} layout over {p} devices needs a multiple of {quantum} tokens, got {n}")
    idx = np.arange(n)
    if layout == "contiguous":
        return idx
    if layout == "striped":
        return idx.reshape(n // p, p).T.reshape(-1)
    if layout == "zigzag":
        blocks = idx.reshape(2 * p, n // (2 * p))
        return np.concatenate([np.concatenate([blocks[j], blocks[2 * p - 1 - j]]) for j in range(p)])
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    return inv


def positions(n: int, p: int, layout: Layout, offset: int = 0) -> np.ndarray:
    """RoPE position ids per device, [p, n/p]: the chunk starts at absolute position `offset`."""
    return (offset + permutation(n, p, layout)).reshape(p, n // p).astype(np.int32)
