"""CSPS Communication-efficient Sparse Attention (CSA, §3.2.4): the CSPS pool's opt-in SP prefill path.

What it computes. The n = p * t tokens are split into p contiguous partitions (SPTs); partition i lives on SP
rank i. The mesh's device order is the proximity order (sort devices by rack, server, GPU before `make_mesh`), so
near partitions sit on near devices. Level v (0-based here, the paper's level v + 1) has segments of spans[v]
consecutive partitions: spans[0] = 1 (the own partition), each span divides the next, spans[-1] = p (the whole
sequence). A query in partition j attends
  - at level 0 to the tokens of its own partition at or before it (causal, nothing dropped), and
  - at level v > 0 to the level's ring: the partitions of its level-v segment outside its level-(v-1) segment,
    through only the top keep_v = round((1 - drops[v]) * t) tokens of each such partition, ranked by `importance`
    separately per KV head (the paper drops per head). Causality leaves only the earlier partitions of a ring.
Each level gives (O_v, lse_v); they merge by Eq. (5), O = sum_v z_v O_v / sum_u z_u, z_v = exp(lse_v) the
softmax denominator, in log-sum-exp form (`merge_attention`). The paper draws level v over its whole segment,
overlapping the levels below; Eq. (5) over overlapping key sets counts the near keys once per level, which is not
attention. We read level v as its segment minus the level below's: the rings are disjoint and with the own
partition cover the sequence, so Eq. (5) is the softmax over the union of the kept keys, and with every drop 0 CSA
is exactly dense causal attention.

Drops: `geometric` is the paper's schedule, read as "level 2+n keeps (1 - p) / 2^n" (jaxserve/sched/csa_cost.py
explains the reading). Importance is an input, one score per key token and KV head; the paper ranks by the
previous layer's attention scores (`importance_from_probs`).

How it moves data, and where it departs from the paper. The paper runs every level's segments as SP-NTP (head
all-to-alls of Q, K, V and the outputs, consolidated per destination) and also drops the unimportant tokens'
queries (their output at that level is zero). Here queries are never dropped and never move: partition i sends
its kept K/V to each later partition j of its rings by ppermute, once, at the level whose ring holds i, and j
computes every level for its own queries. The attention pattern is the paper's without query dropping; the only
traffic is kept K/V (`received_tokens`). Under the geometric schedule that is fewer bytes than SP-NTP's
all-to-alls for SP up to 8 at any level-2 drop; each device's share grows with the log2(p) levels, so larger SP
needs some drop to stay below (csa_cost.comm_fraction). Every device computes over all its ring blocks, masked
where it received none (static shapes); and work is uneven, as in the paper's sequential placement: later
partitions receive more.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jaxserve.pallas_kernels import dispatch as kernels
from jaxserve.pallas_kernels.reference import NO_POSITION, merge_attention
from jaxserve.sched import csa_cost  # the level rules, jax-free, shared with the cost model
from jaxserve.sharding.mesh import SP
from jaxserve.sharding.ring import StoreMetadata, stored_history_attention, write_store


@dataclasses.dataclass(frozen=True)
class Levels:
    spans: tuple[int, ...]  # partitions per segment at each level: 1, ..., p
    drops: tuple[float, ...]  # drop ratio per level; drops[0] = 0

    def __post_init__(self):
        csa_cost.check(self.spans, self.drops)

    @property
    def sp(self) -> int:
        return self.spans[-1]

    def keep(self, t: int) -> tuple[int, ...]:
        """Tokens of a t-token partition kept at each level."""
        return tuple(csa_cost.keep_count(x, t) for x in self.drops)

    def level(self, src: int, dst: int) -> int:
        """The level whose ring holds partition src as seen from partition dst (0 when they are the same)."""
        return next(v for v, s in enumerate(self.spans) if src // s == dst // s)


def geometric(spans: Sequence[int], drop: float) -> Levels:
    """Level 1 keeps all, level 2 drops `drop`, level 2+n keeps (1 - drop) / 2**n."""
    return Levels(tuple(spans), csa_cost.geometric_drops(len(spans), drop))


def importance_from_probs(probs: Float[Array, "h q k"], kv_heads: int) -> Float[Array, "k kvh"]:
    """Attention each key received, summed over the queries and the query heads sharing its KV head (the
    accumulated score of H2O / Scissorhands, the paper's [32-34]): rank the next layer's tokens with a layer's."""
    h, tq, tk = probs.shape
    return probs.reshape(kv_heads, h // kv_heads, tq, tk).sum(axis=(1, 2)).T


@functools.partial(jax.jit, static_argnames="levels")
def csa_mask(importance: Float[Array, "n kvh"], levels: Levels) -> Bool[Array, "L kvh n n"]:
    """Which keys each query sees at each level, per KV head ([level, kv head, query, key])."""
    n, kvh = importance.shape
    p = levels.sp
    t = n // p
    part = jnp.arange(n) // t
    # rank within the partition, 0 the most important; a stable sort breaks ties by position, as top_k does
    order = jnp.argsort(-importance.reshape(p, t, kvh), axis=1, stable=True)
    rank = jnp.argsort(order, axis=1).reshape(n, kvh).T  # [kvh, n]
    causal = jnp.tril(jnp.ones((n, n), bool))
    same = [part[:, None] // s == part[None, :] // s for s in levels.spans]
    rings = [same[0]] + [same[v] & ~same[v - 1] for v in range(1, len(same))]
    return jnp.stack([causal & ring & (rank[:, None, :] < keep) for ring, keep in zip(rings, levels.keep(t))])


def _masked_attention(q, k, v, mask):
    """Softmax attention under a [kvh, q, k] mask: float32 output and log-sum-exp (0 and -inf where none)."""
    t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32) * d**-0.5
    scores = jnp.where(mask[:, None], jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)), -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [kvh, g, t]
    probs = jnp.where(mask[:, None], jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32)).reshape(t, h, d), lse.reshape(h, t).T


@functools.partial(jax.jit, static_argnames="levels")
def csa_reference(
    q: Float[Array, "n h d"],
    k: Float[Array, "n kvh d"],
    v: Float[Array, "n kvh d"],
    importance: Float[Array, "n kvh"],
    levels: Levels,
) -> Float[Array, "n h d"]:
    """CSA on one device over the whole sequence: each level under its mask, merged by Eq. (5)."""
    if q.shape[0] % levels.sp:
        raise ValueError(f"{q.shape[0]} tokens do not split into {levels.sp} partitions")
    parts = [_masked_attention(q, k, v, m) for m in csa_mask(importance, levels)]
    out, _ = merge_attention(jnp.stack([o for o, _ in parts]), jnp.stack([lse for _, lse in parts]))
    return out.astype(q.dtype)


def _ring_perms(levels: Levels, v: int) -> list[list[tuple[int, int]]]:
    """One ppermute per offset o: partition j - o sends to j when j - o lies in j's level-v ring."""
    perms = [
        [(j - o, j) for j in range(o, levels.sp) if levels.level(j - o, j) == v] for o in range(1, levels.spans[v])
    ]
    return [perm for perm in perms if perm]


def csa_partials(
    q: Float[Array, "t h d"],
    k: Float[Array, "t kvh d"],
    v: Float[Array, "t kvh d"],
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " t"],
    importance: Float[Array, "t kvh"],
    *,
    levels: Levels,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
) -> list[tuple[Float[Array, "t h d"], Float[Array, "t h"]]]:
    """Inside `shard_map` over `axis_name` (size levels.sp): this partition's queries over each level's keys,
    (o, lse) per level. Positions mask the own partition causally (padding: queries at -1, keys at NO_POSITION);
    the kept keys of earlier partitions precede every query of this one."""
    t = q.shape[0]
    me = jax.lax.axis_index(axis_name)
    partials = [kernels.chunk_attention(q, k, v, q_pos, k_pos, implementation=implementation)]  # level 0
    for lv, keep in enumerate(levels.keep(t)[1:], start=1):
        perms = _ring_perms(levels, lv)
        if not keep or not perms:
            continue
        top = jax.lax.top_k(importance.T, keep)[1].T[..., None]  # [keep, kvh, 1]: this partition's kept tokens
        kv = jnp.stack([jnp.take_along_axis(x, top, axis=0) for x in (k, v)])  # [2, keep, kvh, d]
        got = jnp.concatenate([jax.lax.ppermute(kv, axis_name, perm) for perm in perms], axis=1)
        # A block is real only where this device was a destination (ppermute leaves zeros elsewhere). Every real
        # block comes from an earlier partition, so all its keys are visible: position 0, else never.
        real = np.array([[j in dict(perm).values() for j in range(levels.sp)] for perm in perms])
        seen = jnp.repeat(jnp.where(jnp.asarray(real)[:, me], 0, NO_POSITION), keep).astype(jnp.int32)
        partials.append(kernels.chunk_attention(q, got[0], got[1], q_pos, seen, implementation=implementation))
    return partials


def csa_attention(
    q: Float[Array, "t h d"],
    k: Float[Array, "t kvh d"],
    v: Float[Array, "t kvh d"],
    importance: Float[Array, "t kvh"],
    *,
    levels: Levels,
    axis_name: str = SP,
    implementation: kernels.Implementation | None = None,
) -> Float[Array, "t h d"]:
    """Inside `shard_map` over `axis_name` (size levels.sp): this partition's queries, CSA output."""
    pos = jnp.arange(q.shape[0], dtype=jnp.int32)
    partials = csa_partials(
        q, k, v, pos, pos, importance, levels=levels, axis_name=axis_name, implementation=implementation
    )
    out, _ = merge_attention(jnp.stack([o for o, _ in partials]), jnp.stack([lse for _, lse in partials]))
    return out.astype(q.dtype)  # Eq. (5)


def own_importance(
    q: Float[Array, "t h d"], k: Float[Array, "t kvh d"], q_pos: Int[Array, " t"], k_pos: Int[Array, " t"]
) -> Float[Array, "t kvh"]:
    """Attention each key of this partition receives from the partition's own queries (`importance_from_probs`
    of this layer's level-0 scores). The paper ranks by the previous layer's scores; this layer's own are at
    hand without carrying anything between layers."""
    t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32) * d**-0.5
    scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)).reshape(h, t, t)
    visible = k_pos[None, :] <= q_pos[:, None]
    peak = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, keepdims=True)
    weights = jnp.where(visible, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    return importance_from_probs(weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30), kvh)


def levels_for(sp: int, drop: float) -> Levels:
    """CSA's levels over a group of `sp` partitions (a power of two): spans 1, 2, 4, ..., sp, and the geometric
    schedule from `drop`; drop 0 drops nothing at any level (CSA's data path, exactly dense attention), where the
    geometric schedule would still halve each farther level."""
    if sp & (sp - 1):
        raise ValueError(f"CSA needs a group of a power of two devices, got {sp}")
    spans = tuple(1 << i for i in range(sp.bit_length()))
    return geometric(spans, drop) if drop else Levels(spans, (0.0,) * len(spans))


@dataclasses.dataclass(frozen=True)
class StoreCSABackend:
    """The model's attention backend inside `shard_map` for a CSPS chunk with CSA: the chunk's own tokens by CSA's
    levels (its partitions are the group's contiguous shards, ranked by `own_importance`), the request's stored
    history dense (as the ring backend reads it), all merged by Eq. (5). caches and metadata as the ring's."""

    levels: Levels
    key_block: int
    axis_name: str = SP
    implementation: kernels.Implementation | None = None

    def __call__(self, q, k, v, positions, caches, layer, metadata: StoreMetadata):
        k_store, v_store = caches
        kw = dict(axis_name=self.axis_name, implementation=self.implementation)
        history = stored_history_attention(
            q[0],
            positions[0],
            k_store,
            v_store,
            metadata.hist_pos,
            layer,
            metadata.blocks,
            key_block=self.key_block,
            **kw,
        )
        importance = own_importance(q[0], k[0], positions[0], metadata.k_pos)
        partials = [
            history,
            *csa_partials(q[0], k[0], v[0], positions[0], metadata.k_pos, importance, levels=self.levels, **kw),
        ]
        out, _ = merge_attention(
            jnp.stack([o.astype(jnp.float32) for o, _ in partials]), jnp.stack([lse for _, lse in partials])
        )
        return out[None].astype(q.dtype), write_store(caches, k, v, layer, metadata.fill)


@functools.partial(jax.jit, static_argnames=("mesh", "levels", "implementation"))
def csa_attention_sp(
    mesh: Mesh,
    q: Float[Array, "n h d"],
    k: Float[Array, "n kvh d"],
    v: Float[Array, "n kvh d"],
    importance: Float[Array, "n kvh"],
    *,
    levels: Levels,
    implementation: kernels.Implementation | None = None,
) -> Float[Array, "n h d"]:
    """CSA over the mesh's SP axis from natural-order arrays: partition i (contiguous) on SP rank i."""
    if mesh.shape[SP] != levels.sp or q.shape[0] % levels.sp:
        raise ValueError(f"CSA for {levels.sp} partitions got an SP axis of {mesh.shape[SP]} and {q.shape[0]} tokens")
    seq = P(SP)
    body = functools.partial(csa_attention, levels=levels, implementation=implementation)
    # check_vma=False: a Pallas kernel inside shard_map has no varying-axes rule (as sharding/attention.py)
    return jax.shard_map(body, mesh=mesh, in_specs=(seq,) * 4, out_specs=seq, check_vma=False)(
        *(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, seq)) for x in (q, k, v, importance))
    )


def received_tokens(levels: Levels, t: int) -> list[int]:
    """K/V tokens (one token's keys and values over all KV heads) each device receives: partition j gets the
    kept tokens of every earlier partition i at the level of i's ring, keep[level(i, j)]."""
    keep = levels.keep(t)
    return [sum(keep[levels.level(i, j)] for i in range(j)) for j in range(levels.sp)]
