"""CSPS Communication-efficient Sparse Attention (CSA, §3.2.4) for cost models: the share of causal attention
pairs, and of SP-NTP (Ulysses) all-to-all bytes, that CSA keeps for given levels, drop ratios and SP size.

The device path is jaxserve/sharding/csa.py; tests/sharding/test_csa.py checks these numbers against it. Its reading of
the paper, in short: the prompt is split into `sp` contiguous partitions of t tokens, one per device in proximity
order. Level v has segments of spans[v] partitions (spans[0] = 1, each span divides the next, spans[-1] = sp).
A query sees its own partition causally (level 1, nothing dropped) and, at level v > 1, the earlier partitions of
its level-v segment that lie outside its level-(v-1) segment (the level's "ring"), through only the
keep_count(drops[v], t) most important tokens of each. Queries stay put: partition i's kept K/V travels once to
each later partition j, at the level whose ring holds i.
"""

from __future__ import annotations

from typing import Sequence


def geometric_drops(levels: int, drop: float) -> tuple[float, ...]:
    """The paper's schedule: level 1 drops nothing, level 2 drops `drop`, level 2+n keeps (1 - drop) / 2**n.

    The paper prints "1 - p = (1 - p')/2^n" for level 2+n's p', which would make farther levels keep more; its
    text says they keep fewer, inversely to distance, so we read it as 1 - p' = (1 - p) / 2^n.
    """
    return (0.0,) + tuple(1 - (1 - drop) / 2**n for n in range(levels - 1))


def keep_count(drop: float, tokens: int) -> int:
    """Tokens of a t-token partition kept at drop ratio `drop` (rounded half up; sharding/csa.py rounds alike)."""
    return int((1 - drop) * tokens + 0.5)


def check(spans: Sequence[int], drops: Sequence[float]) -> None:
    if not spans or spans[0] != 1 or len(drops) != len(spans):
        raise ValueError(f"CSA levels need spans starting at 1 and one drop ratio per level: {spans}, {drops}")
    if any(b <= a or b % a for a, b in zip(spans, spans[1:])):
        raise ValueError(f"each CSA level's span must be a larger multiple of the one below: {spans}")
    if drops[0] != 0 or not all(0 <= d <= 1 for d in drops):
        raise ValueError(f"CSA drop ratios lie in [0, 1] and level 1 drops nothing: {drops}")


def ring_pairs(spans: Sequence[int]) -> tuple[int, ...]:
    """Partition pairs (i < j) whose ring level is v, for each level, over a sequence of spans[-1] partitions.

    A level-v segment of s partitions holds s / s' sub-segments of s' = spans[v-1]; pairs across sub-segments
    number s^2 - s * s' ordered, half of them with i < j.
    """
    sp = spans[-1]
    return (0,) + tuple(sp // s * (s * s - s * inner) // 2 for inner, s in zip(spans, spans[1:]))


def kv_tokens_by_level(spans: Sequence[int], drops: Sequence[float], tokens: int) -> tuple[int, ...]:
    """K/V tokens (each one token's keys and values over all KV heads) the group moves at each level."""
    check(spans, drops)
    return tuple(n * keep_count(d, tokens) for n, d in zip(ring_pairs(spans), drops))


def attention_fraction(spans: Sequence[int], drops: Sequence[float], tokens: int) -> float:
    """Query-key pairs CSA computes over those of dense causal attention, for partitions of `tokens` tokens."""
    sp, t = spans[-1], tokens
    n = sp * t
    kept = sp * t * (t + 1) // 2 + t * sum(kv_tokens_by_level(spans, drops, t))
    return kept / (n * (n + 1) // 2)


def comm_fraction(spans: Sequence[int], drops: Sequence[float], tokens: int, heads: int, kv_heads: int) -> float:
    """CSA's bytes over SP-NTP's (sharding/comm.ulysses_bytes) for one layer's prefill: the factor to scale a
    modelled all-to-all time by. Ulysses moves q, k, v and the output, (sp-1)/sp of each, KV heads replicated up
    to sp when fewer; CSA moves only kept K/V. It can exceed 1: with nothing dropped, large SP and few query heads
    per KV head, shipping every earlier partition's K/V costs more than the head all-to-alls."""
    sp = spans[-1]
    if sp == 1:
        return 1.0  # neither moves anything
    kvh = kv_heads if kv_heads % sp == 0 else max(kv_heads, sp)
    csa = sum(kv_tokens_by_level(spans, drops, tokens)) * 2 * kv_heads
    ulysses = (sp - 1) * tokens * (2 * heads + 2 * kvh)  # (sp - 1) * (sp * t) / sp tokens; head_dim, dtype cancel
    return csa / ulysses
