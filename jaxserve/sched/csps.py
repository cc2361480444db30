"""CSPS (§3.2): a long prompt's prefill over a group of instances, one sequence partition (SPT) of at most `spt`
tokens on each, attention through SP-NTP (Ulysses all-to-alls; live: engine/sp_prefill.py's sp_ntp) with
optional CSA token dropping, the all-to-alls pipelined with the attention (§3.2.5).

- CSPSPlanner: CSPS's prefill plan. A prompt goes whole to the fewest instances (a power of two) whose SPTs
  hold it, on the aligned group that frees up first. One planner, two costs: `serve --cluster_policy=csps`
  plans on Eq. (1) measured on its pool (MeasuredCSPS), the simulator and the lab on a GPU profile
  (CSPSPrefill). Served and simulated through sched/cluster.py's CDSPPolicy (plans made and booked at arrival).
- CSPSPrefill: the profile's time, below.

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
from typing import Protocol, Sequence


from jaxserve.sched import csa_cost, sp_layout
from jaxserve.sched.cdsp import Chunk, ChunkPlan, Pool, Stores, first_free
from jaxserve.sched.cost_models import TetrisPrefill
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
            "sp_ntp",
            tokens,
            shape.hidden,
            sp,
            False,
            network(PROFILES[self.profile][0]),
            "intra_node" if sp <= self.per_node else "inter_node",
        )
        if self.cut and sp > 1:
            spans, drops = self.spans(sp), self.drops(sp, t)
            attention *= csa_cost.attention_fraction(spans, drops, t)
            comm *= csa_cost.comm_fraction(spans, drops, t, shape.heads, shape.kv_heads)
        overlapped = max(attention, comm) if self.pipelined else attention + comm
        return self._cost.linear_ops(t) + overlapped


class PromptSeconds(Protocol):
    def seconds(self, sp: int, tokens: int) -> float:
        """A whole prompt's prefill on `sp` instances."""


@dataclasses.dataclass(frozen=True)
class MeasuredCSPS:
    """The live pool's Eq. (1), measured on its SP-NTP groups: a whole prompt is one chunk with no history."""

    model: TetrisPrefill

    def seconds(self, sp: int, tokens: int) -> float:
        return self.model.predict(sp, tokens)


class CSPSPlanner:
    """A prompt goes whole to the `sp_for(tokens)` instances that free up first, in aligned blocks (within a node
    for groups up to a node, runs of whole nodes beyond): its SPTs are at most `spt` tokens, on at most the
    largest of `sizes` (CSPSPrefill: the model's query heads; live: the sizes measured)."""

    def __init__(
        self,
        model: PromptSeconds,
        pool: Pool,
        spt: int = 131072,
        sizes: Sequence[int] | None = None,
        stores: Stores | None = None,
    ):
        """sizes: the group sizes, powers of two (default: every one the pool holds, and the model's query heads
        for a CSPSPrefill). stores: the instances' history stores, which hold a prompt's SPTs (default:
        unbounded)."""
        if spt < 1:
            raise ValueError(f"spt must be >= 1, got {spt}")
        if sizes is None:
            most = min(pool.size, model_shape(model.profile).heads if isinstance(model, CSPSPrefill) else pool.size)
            sizes = [1 << i for i in range(most.bit_length())]
        self.sizes = sorted(sizes)
        bad = [
            s
            for s in self.sizes
            if s & (s - 1)
            or s > pool.size
            or (s > pool.per_node and s % pool.per_node)
            or (s < pool.per_node and pool.per_node % s)
        ]
        if not self.sizes or bad:
            raise ValueError(
                f"CSPS's groups are powers of two in whole nodes of {pool.per_node} (or within one), "
                f"at most the pool's {pool.size}: got {list(sizes)}"
            )
        self.model, self.pool, self.spt, self.stores = model, pool, spt, stores

    def sp_for(self, tokens: int) -> int:
        """The fewest instances whose SPTs (and stores) hold the prompt; the largest size if none does."""
        fits = [
            s for s in self.sizes if s * self.spt >= tokens and (self.stores is None or self.stores.fits(s, tokens, 0))
        ]
        return fits[0] if fits else self.sizes[-1]

    def longest(self) -> int | None:
        """The longest prompt the pool's stores hold (None: unbounded)."""
        return None if self.stores is None else self.stores.longest(self.sizes[-1])

    def groups(self, sp: int | None = None) -> list[tuple[int, ...]]:
        """The groups of `sp` instances a prompt may take (None: of every size)."""
        if sp is None:
            return [g for s in self.sizes for g in self.groups(s)]
        step = min(sp, self.pool.per_node)  # groups of whole nodes start at any node
        return [tuple(range(g, g + sp)) for g in range(0, self.pool.size - sp + 1, step)]

    def on_arrival(self, t: float) -> None:
        del t  # plans from the queues alone

    def plan(self, tokens: int, queues: Sequence[float]) -> ChunkPlan:
        sp = self.sp_for(tokens)
        group, start = first_free(self.groups(sp), queues)
        return ChunkPlan((Chunk(tokens, 0, group, start, start + self.model.seconds(sp, tokens)),))

    def fastest(self, tokens: int) -> float:
        """A prompt's prefill on an idle pool: what its TTFT deadline scales with."""
        return self.model.seconds(self.sp_for(tokens), tokens)
