"""CSPS 3.2.2: which sequence-parallel layout a long prompt should use on N GPUs that also run tensor
parallelism, from the bytes each moves per layer (CSPS supplementary material).

- SP-NTP (Ulysses-style): two all-to-alls of the sequence's QKV and attention output, (3 + 1) L d / N^2 per
  GPU pair; under TP every GPU must also gather the layer's attention weights (3 d^2 + d^2) / N per pair.
- SP-TP: an all-gather of the layer input and a reduce-scatter of the attention output, L d / N per pair each.

Summed over the N(N - 1) pairs: SP-NTP moves (4 d^2 + 4 L d / N)(N - 1), SP-TP 2 L d (N - 1). SP-NTP wins once
L > 2 d N / (N - 2) (never for N <= 2; the paper's text says "always" for N = 2, its own formula says never).
Without TP there are no weights to gather and SP-NTP always moves less. The time comes from the link model
(cost_models.LinkModel): each GPU sends its share, all in parallel.
"""

from __future__ import annotations

from typing import Literal

from jaxserve.sched.cost_models import LinkModel

Layout = Literal["sp_ntp", "sp_tp"]


def layer_bytes(
    layout: Layout, tokens: int, hidden: int, gpus: int, tensor_parallel: bool, dtype_bytes: int = 2
) -> float:
    """Bytes the group moves for one layer of a `tokens`-token prompt (d = hidden, N = gpus)."""
    n, d, length = gpus, hidden, tokens
    if n < 2:
        return 0.0
    if layout == "sp_tp":
        return dtype_bytes * 2 * length * d * (n - 1)
    weights = 4 * d * d if tensor_parallel else 0
    return dtype_bytes * (weights + 4 * length * d / n) * (n - 1)


def choose(tokens: int, hidden: int, gpus: int, tensor_parallel: bool) -> Layout:
    """The layout that moves fewer bytes (SP-TP only exists with TP)."""
    if not tensor_parallel:
        return "sp_ntp"
    ntp, tp = (layer_bytes(x, tokens, hidden, gpus, True) for x in ("sp_ntp", "sp_tp"))
    return "sp_ntp" if ntp < tp else "sp_tp"


def layer_seconds(
    layout: Layout, tokens: int, hidden: int, gpus: int, tensor_parallel: bool, link: LinkModel, link_name: str
) -> float:
    """One layer's communication: every GPU sends its 1 / gpus of the bytes at once over `link_name`."""
    if gpus < 2:
        return 0.0
    return link.predict(link_name, layer_bytes(layout, tokens, hidden, gpus, tensor_parallel) / gpus)
