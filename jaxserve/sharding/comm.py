"""Bytes each SP strategy moves per layer, for the planners (sched/ reads these through plain numbers).

All figures are totals over the group (what the network carries), for one transformer layer:
t new tokens on p devices, h query / kvh KV heads of head_dim d, history of n tokens, e = model width.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.sharding.rebalance import moved_tokens


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int  # t: new tokens of the chunk (prefill) or requests in the batch (decode)
    devices: int  # p: SP group size
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    history: int = 0  # n: cached tokens of the request(s)
    dtype_bytes: int = 2

    @property
    def kv_token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def ring_bytes(s: Shape) -> int:
    """Chunk K/V: every device forwards each other device's block once, (p - 1) hops of t/p tokens each.
    History (when there is one): the queries move instead, all-gathered, and the float32 (o, weight) partials
    return by reduce-scatter, plus an all-reduce of the log-sum-exp maxima."""
    p = s.devices
    chunk = (p - 1) * s.tokens * s.kv_token_bytes
    if s.history == 0:
        return chunk
    queries = (p - 1) * s.tokens * s.heads * s.head_dim * s.dtype_bytes
    partials = (p - 1) * s.tokens * s.heads * (s.head_dim + 1) * 4  # every device's [t, h, d + 1] for the others
    maxima = 2 * (p - 1) * s.tokens * s.heads * 4
    return chunk + queries + partials + maxima


def ulysses_bytes(s: Shape) -> int:
    """All-to-all of q, k, v (KV heads replicated up to p if fewer) and of the output: (p-1)/p of each stays off."""
    p = s.devices
    kvh = s.kv_heads if s.kv_heads % p == 0 else max(s.kv_heads, p)
    per_token = (2 * s.heads + 2 * kvh) * s.head_dim * s.dtype_bytes
    return (p - 1) * (s.tokens + s.history) * per_token // p if p > 1 else 0


def sp_tp_bytes(s: Shape) -> int:
    """All-gather of the layer input plus reduce-scatter of the attention output, t x e values each."""
    return 2 * (s.devices - 1) * s.tokens * s.hidden * s.dtype_bytes


def kv_moving_decode_bytes(s: Shape) -> int:
    """Decode by gathering the KV to one device: every remote shard of the n cached tokens moves."""
    return (s.devices - 1) * s.history * s.kv_token_bytes // s.devices


def query_moving_decode_bytes(s: Shape) -> int:
    """Decode by moving the query (KV-parallel): q to p - 1 devices, (o, lse) partials back, per request."""
    q = s.heads * s.head_dim * s.dtype_bytes
    partial = s.heads * (s.head_dim * s.dtype_bytes + 4)  # output + float32 log-sum-exp
    return (s.devices - 1) * s.tokens * (q + partial)


def rebalance_bytes(counts: Sequence[int], kv_token_bytes: int) -> int:
    """KV moved to balance a history held as `counts` tokens per device of the new group (joiners hold 0)."""
    return moved_tokens(counts) * kv_token_bytes


def per_layer_bytes(s: Shape) -> dict[str, int]:
    return {
        "ring": ring_bytes(s),
        "ulysses": ulysses_bytes(s),
        "sp_tp": sp_tp_bytes(s),
        "decode_kv_moving": kv_moving_decode_bytes(s),
        "decode_query_moving": query_moving_decode_bytes(s),
    }
