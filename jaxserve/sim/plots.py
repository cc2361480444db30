"""Plots people would rather see than read: TTFT CDFs per policy, latency against load, and Gantt charts of
prefill chunks on the pool's devices."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np
from matplotlib.figure import Figure  # not pyplot: no global backend switch in the caller's notebook

from jaxserve.sim.metrics import Results


def ttft_cdf(runs: Mapping[str, Results], path: str, which: str = "short", title: str = "") -> None:
    """One CDF line per labelled run; `which`: 'short', 'long' or 'all' requests (by the run's long threshold)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, res in runs.items():
        ttft = [
            r.first_token_at - r.arrival
            for r in res.requests
            if r.first_token_at is not None
            and (which == "all" or (r.prompt_len >= res.long_threshold) == (which == "long"))
        ]
        if ttft:
            x = np.sort(ttft)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel(f"TTFT of {which} requests (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def metric_vs_load(
    rows: Sequence[Mapping], path: str, metric: str, ylabel: str, title: str = "", log: bool = True
) -> None:
    """rows: {'label', 'rate', metric}: one line per label across arrival rates."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = sorted((r["rate"], r[metric]) for r in rows if r["label"] == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class Bar(NamedTuple):
    """One chunk on a Gantt chart: request index, pool instances (0-based), seconds."""

    request: int
    group: tuple[int, ...]
    start: float
    end: float


def gantt(panels: Mapping[str, Sequence[Bar]], devices: int, path: str, title: str = "") -> None:
    """Side-by-side Gantt charts (one per labelled run, shared axes): each chunk a bar on every instance of its
    group, coloured and numbered by request."""
    fig = Figure(figsize=(6 * len(panels), 0.4 * devices + 1.8))
    axes = fig.subplots(1, len(panels), sharex=True, sharey=True, squeeze=False)[0]
    colors = [f"C{i}" for i in range(10)]
    for ax, (label, bars) in zip(axes, panels.items()):
        for b in bars:
            for i in b.group:
                ax.broken_barh(
                    [(b.start, b.end - b.start)],
                    (i - 0.4, 0.8),
                    color=colors[b.request % 10],
                    edgecolor="black",
                    linewidth=0.3,
                )
            ax.text((b.start + b.end) / 2, min(b.group), str(b.request), ha="center", va="center", fontsize=6)
        ax.set_title(label)
        ax.set_xlabel("seconds from the first arrival")
        ax.set_yticks(range(devices))
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_ylabel("prefill instance")
    axes[0].invert_yaxis()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
