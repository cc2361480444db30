"""Attention times on this GPU for the simulator's cost model (sched/profiles.py): cuDNN flash attention in bf16
at each built-in profile's per-GPU head counts (heads / TP), batch 1.

    python3 tools/profile/attention.py --out=jaxserve/sched/data/h100_attention.csv

kind=prefill: a causal prompt of n tokens (no history). kind=history: n queries over h earlier tokens (not causal;
with the causal prefill of the n tokens themselves this is a chunk over history). kind=decode: `batch` single
queries over h tokens each (XLA's attention; cuDNN's needs more than one query). Times are medians of --repeats
after a warm-up (which compiles); rows record the FLOPs and KV bytes the cost model credits.
"""

from __future__ import annotations

import csv
import pathlib

import jax
import jax.numpy as jnp
from absl import app, flags
from tqdm import tqdm

from jaxserve.engine.profile import median_time

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "attention_profile.csv", "CSV to write (rewritten after every measurement).")
flags.DEFINE_list(
    "heads",
    ["64/8", "32/4", "16/2", "8/1", "32/32", "16/16", "8/8", "4/4"],
    "Query/KV heads per GPU: Llama-2-70B and Llama-2-7B at TP 1, 2, 4, 8.",
)
flags.DEFINE_list(
    "prefill", ["256", "512", "1024", "2048", "4096", "8192", "16384", "32768", "65536"], "Causal prompt lengths."
)
flags.DEFINE_list("history", ["512:8192", "2048:32768", "8192:131072"], "n:h pairs for the history rows.")
flags.DEFINE_list("decode", ["4096", "32768", "131072"], "Context lengths for the decode rows.")
flags.DEFINE_integer("batch", 8, "Decode batch.")
flags.DEFINE_integer("head_dim", 128, "Head dimension.")
flags.DEFINE_integer("repeats", 5, "Timed repetitions.")

FIELDS = ("kind", "heads", "kv_heads", "n", "h", "batch", "seconds", "flops", "kv_bytes")


def normal(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.bfloat16)


@jax.jit
def causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


@jax.jit
def full(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


@jax.jit
def decode(q, k, v):
    return jax.nn.dot_product_attention(q, k, v)


def rows(d: int):
    for spec in FLAGS.heads:
        hq, hkv = (int(x) for x in spec.split("/"))
        for n in map(int, FLAGS.prefill):
            q, k, v = normal(0, (1, n, hq, d)), normal(1, (1, n, hkv, d)), normal(2, (1, n, hkv, d))
            yield (
                dict(
                    kind="prefill",
                    heads=hq,
                    kv_heads=hkv,
                    n=n,
                    h=0,
                    batch=1,
                    flops=2 * n * (n + 1) * hq * d,
                    kv_bytes=2 * 2 * n * hkv * d,
                ),
                causal,
                (q, k, v),
            )
        for pair in FLAGS.history:
            n, h = (int(x) for x in pair.split(":"))
            q, k, v = normal(0, (1, n, hq, d)), normal(1, (1, h, hkv, d)), normal(2, (1, h, hkv, d))
            yield (
                dict(
                    kind="history",
                    heads=hq,
                    kv_heads=hkv,
                    n=n,
                    h=h,
                    batch=1,
                    flops=4 * n * h * hq * d,
                    kv_bytes=2 * 2 * h * hkv * d,
                ),
                full,
                (q, k, v),
            )
        for h in map(int, FLAGS.decode):
            b = FLAGS.batch
            q, k, v = normal(0, (b, 1, hq, d)), normal(1, (b, h, hkv, d)), normal(2, (b, h, hkv, d))
            yield (
                dict(
                    kind="decode",
                    heads=hq,
                    kv_heads=hkv,
                    n=1,
                    h=h,
                    batch=b,
                    flops=4 * b * h * hq * d,
                    kv_bytes=b * 2 * 2 * h * hkv * d,
                ),
                decode,
                (q, k, v),
            )


def main(argv):
    del argv
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    out = pathlib.Path(FLAGS.out)
    measured = []
    total = len(FLAGS.heads) * (len(FLAGS.prefill) + len(FLAGS.history) + len(FLAGS.decode))
    for row, fn, args in tqdm(rows(FLAGS.head_dim), desc="attention", total=total):  # one case's arrays at a time
        try:
            row["seconds"] = median_time(lambda: jax.block_until_ready(fn(*args)), FLAGS.repeats)
        except Exception as err:  # noqa: BLE001 (e.g. out of memory at one shape: the rest still run)
            print(f"{row}: {type(err).__name__}: {str(err)[:200]}")
            continue
        measured.append(row)
        with out.open("w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(measured)
    for r in measured:
        rate = r["flops"] / r["seconds"] / 1e12
        print(
            f"{r['kind']:8} {r['heads']:>3}/{r['kv_heads']:<3} n={r['n']:>6} h={r['h']:>7} b={r['batch']} "
            f"{1e3 * r['seconds']:9.3f} ms {rate:7.1f} TFLOP/s {r['kv_bytes'] / r['seconds'] / 1e9:8.1f} GB/s"
        )


if __name__ == "__main__":
    app.run(main)
