"""Meshes with ('sp', 'tp') axes built from an ordered device group, and sub-meshes for a chunk's group."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

SP = "sp"
TP = "tp"


def make_mesh(devices: Sequence[jax.Device], tp: int = 1) -> Mesh:
    """Mesh over `devices` in the given order: consecutive runs of `tp` devices form one SP rank."""
    if not devices or len(devices) % tp:
        raise ValueError(f"{len(devices)} devices cannot form an SP x TP mesh with tp={tp}")
    return Mesh(np.asarray(devices, dtype=object).reshape(len(devices) // tp, tp), (SP, TP))


def group_mesh(pool: Sequence[jax.Device], group: Sequence[int], tp: int = 1) -> Mesh:
    """Sub-mesh for a CDSP chunk: the pool devices with the given ids, in the group's order."""
    by_id = {d.id: d for d in pool}
    missing = [i for i in group if i not in by_id]
    if missing or len(set(group)) != len(group):
        raise ValueError(f"group {tuple(group)} is not a set of distinct device ids from the pool")
    return make_mesh([by_id[i] for i in group], tp)
