"""CSPS's prefill (§3.2) for the simulator: a prompt split into sequence partitions (SPTs) of at most `spt` tokens,
one per GPU of a group, attention through SP-NTP (Ulysses all-to-alls, no TP: an 8B model fits one GPU) with
optional CSA token dropping, the all-to-alls pipelined with the attention (§3.2.5).

Time of an L-token prompt on N GPUs, all layers (t = L / N tokens per GPU; N at most the query heads, which
SP-NTP splits across the GPUs):
    linear ops of t tokens (measured, TP 1)
  + max(attention, all-to-alls)     pipelined (three-phase); their sum without pipelining
attention: causal attention of L tokens over N GPUs (each holds heads / N), times CSA's kept share of the pairs:
CSA runs each level's attention SP-NTP-style inside the level's segments (§3.2.4: the segment's GPUs split the
heads), so the work stays balanced (our device path, sharding/csa.py, keeps queries in place instead, where the
last partition would set the time); all-to-alls: SP-NTP's bytes (sp_layout) over NVLink inside a node or the
inter-node link beyond it, times CSA's bytes over SP-NTP's (csa_cost). CSA's levels follow the GPUs' proximity:
one partition, one node, the group.

CSA's drop ratios come from the paper's measured effect, not a guess at its regression model: at its default (no
accuracy loss) CSA did 28% less attention computation (§5.3), so the level-2 drop p (farther levels keeping
(1 - p) / 2^n, csa_cost.geometric_drops) is solved per group so that the pairs kept are 1 - `cut` of dense. Over
many nodes that schedule drops more than `cut` even at p = 0 (its third level keeps half); there level 2 keeps
everything and the last level's drop is solved instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from jaxserve.lab import sp_layout
from jaxserve.sched import csa_cost
from jaxserve.sched.cdsp import Chunk, ChunkPlan, Pool
from jaxserve.sched.profiles import PROFILES, ProfileBatchCost, model_shape, network


@dataclasses.dataclass(frozen=True)
class CSPSPrefill:
    profile: str = "a100_llama3_8b"
    per_node: int = 8
    cut: float = 0.28  # CSA's share of attention pairs dropped; 0: plain SP-NTP, every token sees every earlier one
    pipelined: bool = True

    def __post_init__(self):
        if not 0 <= self.cut < 1:
            raise ValueError(f"cut must be in [0, 1), got {self.cut}")

    @functools.cached_property
    def _cost(self) -> ProfileBatchCost:
        return ProfileBatchCost(self.profile, tp=1)

    def spans(self, sp: int) -> tuple[int, ...]:
        """CSA's levels for a group of `sp` GPUs: a partition, the GPUs of one node, the whole group."""
        if sp == 1:
            return (1,)
        return (1, sp) if sp <= self.per_node else (1, self.per_node, sp)

    def drops(self, sp: int, t: int) -> tuple[float, ...]:
        """Per-level drop ratios for `sp` partitions of `t` tokens that keep 1 - cut of the causal pairs."""
        spans = self.spans(sp)
        levels = len(spans)
        geometric = csa_cost.attention_fraction(spans, csa_cost.geometric_drops(levels, 0.0), t) >= 1 - self.cut

        def schedule(p: float) -> tuple[float, ...]:
            return csa_cost.geometric_drops(levels, p) if geometric else (0.0,) * (levels - 1) + (p,)

        lo, hi = 0.0, 1.0
        for _ in range(40):  # the kept share falls as p rises
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if csa_cost.attention_fraction(spans, schedule(mid), t) > 1 - self.cut else (lo, mid)
        return schedule(hi)

    def seconds(self, sp: int, tokens: int) -> float:
        shape = model_shape(self.profile)
        t = -(-tokens // sp)
        if sp > shape.heads:
            raise ValueError(f"SP-NTP splits {shape.heads} heads: no more than {shape.heads} GPUs, got {sp}")
        attention = self._cost.prefill_attention(tokens, 0) / sp
        comm = self._cost.layers * sp_layout.layer_seconds(
            "sp_ntp", tokens, shape.hidden, sp, False, network(PROFILES[self.profile][0]),
            "intra_node" if sp <= self.per_node else "inter_node")
        if self.cut and sp > 1:
            spans, drops = self.spans(sp), self.drops(sp, t)
            attention *= csa_cost.attention_fraction(spans, drops, t)
            comm *= csa_cost.comm_fraction(spans, drops, t, shape.heads, shape.kv_heads)
        overlapped = max(attention, comm) if self.pipelined else attention + comm
        return self._cost.linear_ops(t) + overlapped


class CSPSPlanner:
    """A prompt goes whole to the `sp_for(tokens)` GPUs that free up first, in aligned blocks (one node's GPUs
    for groups up to a node, runs of whole nodes beyond): its SPTs are at most `spt` tokens, as CSPS's 64K-128K,
    on at most as many GPUs as the model has query heads (and the pool holds)."""

    def __init__(self, model: CSPSPrefill, pool: Pool, spt: int = 131072):
        if spt < 1:
            raise ValueError(f"spt must be >= 1, got {spt}")
        self.model, self.pool, self.spt = model, pool, spt

    def sp_for(self, tokens: int) -> int:
        most = min(self.pool.size, model_shape(self.model.profile).heads)
        return min(1 << max(math.ceil(math.log2(tokens / self.spt)), 0), 1 << int(math.log2(most)))

    def on_arrival(self, t: float) -> None:
        del t  # plans from the queues alone

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        sp = self.sp_for(tokens)
        q = np.maximum(np.asarray(queues, np.float64), 0.0)
        step = sp if sp <= self.pool.per_node else self.pool.per_node  # groups of whole nodes start at any node
        groups = [tuple(range(g, g + sp)) for g in range(0, self.pool.size - sp + 1, step)]
        group = min(groups, key=lambda g: q[list(g)].max())
        start = float(q[list(group)].max())
        return ChunkPlan((Chunk(tokens, 0, group, start, start + self.model.seconds(sp, tokens)),))

    def fastest(self, tokens: int) -> float:
        """A prompt's prefill on an idle pool: what its TTFT deadline scales with."""
        return self.model.seconds(self.sp_for(tokens), tokens)
