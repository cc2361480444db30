"""Bytes one layer's attention moves over an SP group, read from the compiled programs: CSPS's SP-NTP (head
all-to-alls of Q, K, V and the output) against its CSA at several drop ratios (only the kept K/V, by ppermute),
beside the cost model's prediction (sched/csa_cost.comm_fraction). CPU devices suffice: the bytes are the
programs', not a run's.

    .venv/bin/python tools/profile/csa_bytes.py [--sp=2,4,8] [--drops=0,0.5,0.9] [--tokens=64] [--heads=8]

Prints a markdown table (bytes the whole group sends per layer, float32; CSA's share of SP-NTP's in brackets).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxserve.sched import csa_cost  # noqa: E402
from jaxserve.sharding import csa, overlap  # noqa: E402
from jaxserve.sharding.attention import chunk_attention_sp  # noqa: E402
from jaxserve.sharding.mesh import make_mesh  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("sp", ["2", "4", "8"], "SP group sizes (powers of two, at most the devices).")
flags.DEFINE_list("drops", ["0", "0.5", "0.9"], "CSA drop ratios at level 2 (the geometric schedule beyond).")
flags.DEFINE_integer("tokens", 64, "Tokens a device holds.")
flags.DEFINE_integer("heads", 8, "Query heads, and KV heads (as many: MHA).")
flags.DEFINE_integer("head_dim", 16, "Head dimension.")


def sent(p: int, fn, *args) -> dict[str, int]:
    return overlap.collective_bytes(jax.jit(fn).lower(*args).compile().as_text(), devices=p)


def row(p: int) -> list[str]:
    n, h, d = FLAGS.tokens * p, FLAGS.heads, FLAGS.head_dim
    q = k = v = jnp.ones((n, h, d))
    pos = jnp.arange(n, dtype=jnp.int32)
    mesh = make_mesh(jax.devices()[:p])
    empty = (jnp.zeros((0, h, d)), jnp.zeros((0, h, d)), jnp.zeros((0,), jnp.int32))  # no history
    dense = sent(
        p, lambda *a: chunk_attention_sp(mesh, *a, strategy="ulysses", layout="contiguous"), q, k, v, pos, pos, *empty
    )["all-to-all"]
    cells = [str(p), f"{dense:,}"]
    for drop in map(float, FLAGS.drops):
        levels = csa.levels_for(p, drop)
        got = sent(p, lambda *a: csa.csa_attention_sp(mesh, *a, levels=levels), q, k, v, jnp.ones((n, h))).get(
            "collective-permute", 0
        )
        model = csa_cost.comm_fraction(levels.spans, levels.drops, FLAGS.tokens, h, h)
        cells.append(f"{got:,} ({got / dense:.3g}x; model {model:.3g}x)")
    return cells


def main(argv: list[str]) -> None:
    del argv
    print("| SP | SP-NTP | " + " | ".join(f"CSA drop {d}" for d in FLAGS.drops) + " |")
    print("|---:|---:|" + "---:|" * len(FLAGS.drops))
    for p in map(int, FLAGS.sp):
        print("| " + " | ".join(row(p)) + " |")


if __name__ == "__main__":
    app.run(main)
