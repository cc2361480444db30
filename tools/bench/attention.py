"""Attention kernels on one GPU: chunk attention vs cuDNN, decode bandwidth vs copy bandwidth, ring step time.

    .venv/bin/python tools/bench/attention.py [--seqs=4096,8192] [--out=bench_attention.json]
    .venv/bin/python tools/bench/attention.py --smoke     # tiny sizes, any backend (CPU: interpret mode)

(a) Causal chunk attention, bfloat16: the Pallas kernel vs `jax.nn.dot_product_attention(implementation='cudnn',
    is_causal=True, return_residual=True)` (both return the log-sum-exp). Both are credited the causal FLOPs
    2 * 2 * t * t * h * d / 2, whatever they compute.
(b) Paged decode attention (the split-KV partials, not the merge): bytes of K and V for the kv_lens over time,
    against the device's copy bandwidth, measured as bytes read + written by an elementwise pass over a large array.
(c) Ring attention (`jaxserve.sharding.ring`) over all local devices, zigzag layout: time per ring step. Skipped
    with a note while that module cannot be imported.

Times are medians over --repeats after one warm-up call (which compiles). With --smoke, or on a backend other than
GPU, the baseline is the pure-jnp reference and the kernel runs where it can (interpret mode off GPU): those
figures check that the script runs, they are not GPU figures.
"""

from __future__ import annotations

import functools
import json
import pathlib
import traceback
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

from jaxserve.engine import profile
from jaxserve.pallas_kernels import dispatch, reference

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "Tiny sizes and the jnp reference as baseline: runs anywhere, CPU included.")
flags.DEFINE_list("seqs", ["4096", "8192", "16384", "32768", "65536"], "Chunk lengths for (a).")
flags.DEFINE_integer("heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dimension.")
flags.DEFINE_integer("block_q", 128, "Chunk kernel query tile.")
flags.DEFINE_integer("block_k", 64, "Chunk kernel key tile.")
flags.DEFINE_integer("decode_batch", 8, "Requests in the decode batch.")
flags.DEFINE_integer("decode_kv_len", 32768, "Cached tokens per decode request.")
flags.DEFINE_integer("block_size", 16, "KV cache block size (tokens).")
flags.DEFINE_integer("num_splits", 16, "Decode KV splits.")
flags.DEFINE_integer("copy_mib", 2048, "Array size for the copy-bandwidth measurement.")
flags.DEFINE_integer("ring_tokens", 16384, "Chunk tokens for the ring attention measurement.")
flags.DEFINE_integer("ring_history", 16384, "History tokens before the ring chunk.")
flags.DEFINE_integer("repeats", 5, "Timed repetitions; the median is reported.")
flags.DEFINE_string("out", None, "JSON file for the results, rewritten after every measurement.")

DTYPE = jnp.bfloat16


def median_time(fn: Callable[..., object], *args, repeats: int) -> float:
    """Median seconds of fn(*args) to its results, after a first call that compiles and warms up."""
    return profile.median_time(lambda: jax.block_until_ready(fn(*args)), repeats)


def random(key: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, DTYPE)


def bench_chunk(seqs: list[int], on_gpu: bool, impl: str) -> Iterator[dict]:
    h, kvh, d = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
    kernel = jax.jit(
        functools.partial(dispatch.chunk_attention, implementation=impl, block_q=FLAGS.block_q, block_k=FLAGS.block_k)
    )
    if on_gpu:
        baseline_name = "cudnn"
        baseline = jax.jit(
            lambda q, k, v, pos: jax.nn.dot_product_attention(
                q[None], k[None], v[None], is_causal=True, implementation="cudnn", return_residual=True
            )
        )
    else:
        baseline_name = "jnp reference"
        baseline = jax.jit(lambda q, k, v, pos: reference.chunk_attention(q, k, v, pos, pos))
    for t in tqdm(seqs, desc="chunk attention"):
        q, k, v = random(0, (t, h, d)), random(1, (t, kvh, d)), random(2, (t, kvh, d))
        pos = jnp.arange(t, dtype=jnp.int32)
        tflop = 2 * 2 * t * t * h * d / 2 / 1e12
        t_kernel = median_time(kernel, q, k, v, pos, pos, repeats=FLAGS.repeats)
        t_base = median_time(baseline, q, k, v, pos, repeats=FLAGS.repeats)
        del q, k, v
        yield dict(
            seq=t,
            kernel_ms=1e3 * t_kernel,
            kernel_tflops=tflop / t_kernel,
            baseline=baseline_name,
            baseline_ms=1e3 * t_base,
            baseline_tflops=tflop / t_base,
        )


def copy_bandwidth(mib: int) -> float:
    """Bytes read + written per second by one elementwise pass over a `mib` MiB array."""
    x = jnp.ones((mib * 2**20 // jnp.dtype(DTYPE).itemsize,), DTYPE)
    seconds = median_time(jax.jit(lambda x: x + 1), x, repeats=FLAGS.repeats)
    return 2 * x.nbytes / seconds


def bench_decode(impl: str, batch: int, kv_len: int, copy_mib: int) -> dict:
    h, kvh, d, bs, n = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.block_size, FLAGS.num_splits
    nblk = -(-kv_len // (bs * n)) * n  # table width: a multiple of the splits
    num_blocks = batch * nblk
    tables = jax.random.permutation(jax.random.key(3), num_blocks).reshape(batch, nblk).astype(jnp.int32)
    k_cache, v_cache = random(4, (num_blocks * bs, kvh, d)), random(5, (num_blocks * bs, kvh, d))
    q = random(6, (batch, h, d))
    kv_lens = jnp.full((batch,), kv_len, jnp.int32)
    fn = jax.jit(functools.partial(dispatch.paged_decode_attention, block_size=bs, num_splits=n, implementation=impl))
    seconds = median_time(fn, q, k_cache, v_cache, tables, kv_lens, repeats=FLAGS.repeats)
    kv_bytes = 2 * int(kv_lens.sum()) * kvh * d * jnp.dtype(DTYPE).itemsize
    copy = copy_bandwidth(copy_mib)
    return dict(
        batch=batch,
        kv_len=kv_len,
        block_size=bs,
        num_splits=n,
        ms=1e3 * seconds,
        kv_bytes=kv_bytes,
        gbps=kv_bytes / seconds / 1e9,
        copy_gbps=copy / 1e9,
        fraction_of_copy=kv_bytes / seconds / copy,
    )


def bench_ring(tokens: int, history: int) -> dict:
    try:
        from jaxserve.sharding import layouts, mesh, ring
    except ImportError as err:
        print(f"ring attention skipped: jaxserve.sharding.ring is not importable ({err})")
        return dict(skipped=str(err))
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    p = len(devices)
    h, kvh, d = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
    tokens, history = -(-tokens // (2 * p)) * 2 * p, -(-history // p) * p  # zigzag needs multiples of 2p
    m = mesh.make_mesh(devices)
    shard = NamedSharding(m, P(mesh.SP))
    q_pos = history + layouts.permutation(tokens, p, "zigzag").astype(np.int32)  # device-major zigzag order
    args = dict(
        q=random(7, (tokens, h, d)),
        k=random(8, (tokens, kvh, d)),
        v=random(9, (tokens, kvh, d)),
        q_pos=q_pos,
        k_pos=q_pos,
        hist_k=random(10, (history, kvh, d)),
        hist_v=random(11, (history, kvh, d)),
        hist_pos=np.arange(history, dtype=np.int32),
    )
    args = {name: jax.device_put(a, shard) for name, a in args.items()}

    def step(args):
        return ring.ring_attention(**args, axis_size=p)

    # check_vma=False: a Pallas call inside shard_map has no varying-axes rule (it fails at trace time otherwise)
    fn = jax.jit(
        jax.shard_map(step, mesh=m, in_specs=(P(mesh.SP),), out_specs=(P(mesh.SP), P(mesh.SP)), check_vma=False)
    )
    seconds = median_time(fn, args, repeats=FLAGS.repeats)
    return dict(devices=p, tokens=tokens, history=history, ms=1e3 * seconds, step_ms=1e3 * seconds / p)


def main(argv):
    del argv
    on_gpu = jax.default_backend() == "gpu"
    gpu_figures = on_gpu and not FLAGS.smoke
    impl = "kernel" if on_gpu else "interpret"
    if FLAGS.smoke:
        seqs, batch, kv_len, copy_mib, ring_tokens, ring_history = [256], 2, 256, 16, 256, 256
    else:
        seqs = [int(s) for s in FLAGS.seqs]
        batch, kv_len, copy_mib = FLAGS.decode_batch, FLAGS.decode_kv_len, FLAGS.copy_mib
        ring_tokens, ring_history = FLAGS.ring_tokens, FLAGS.ring_history
    device = jax.devices()[0].device_kind
    print(
        f"device: {device} ({jax.default_backend()}, {jax.device_count()} devices), jax {jax.__version__}, "
        f"kernel implementation: {impl}"
    )
    if not gpu_figures:
        print("NOTE: --smoke or no GPU: baseline is the jnp reference, not cuDNN; these are NOT GPU figures.")

    results = dict(
        device=device,
        backend=jax.default_backend(),
        jax=jax.__version__,
        gpu_figures=gpu_figures,
        implementation=impl,
        heads=FLAGS.heads,
        kv_heads=FLAGS.kv_heads,
        head_dim=FLAGS.head_dim,
        block_q=FLAGS.block_q,
        block_k=FLAGS.block_k,
        repeats=FLAGS.repeats,
        chunk=[],
    )

    def save() -> None:  # after every measurement: a crash (or a GPU session's time limit) keeps what was measured
        if FLAGS.out:
            pathlib.Path(FLAGS.out).write_text(json.dumps(results, indent=2))

    def part(name: str, measure: Callable[[], object]) -> None:
        try:
            results[name] = measure()
        except Exception as err:  # noqa: BLE001 (recorded; the other parts still run)
            traceback.print_exc()
            results[f"{name}_error"] = f"{type(err).__name__}: {err}"
        save()

    def chunk() -> list[dict]:
        for row in bench_chunk(seqs, gpu_figures, impl):
            results["chunk"].append(row)
            save()
        return results["chunk"]

    part("chunk", chunk)
    part("decode", lambda: bench_decode(impl, batch, kv_len, copy_mib))
    part("ring", lambda: bench_ring(ring_tokens, ring_history))

    print(f"\n(a) causal chunk attention, {FLAGS.heads}/{FLAGS.kv_heads} heads, head_dim {FLAGS.head_dim}, bf16")
    print(f"{'seq':>7} {'kernel ms':>10} {'TFLOP/s':>8} {'baseline':>14} {'ms':>10} {'TFLOP/s':>8}")
    for r in results["chunk"]:
        print(
            f"{r['seq']:>7} {r['kernel_ms']:>10.3f} {r['kernel_tflops']:>8.2f} {r['baseline']:>14} "
            f"{r['baseline_ms']:>10.3f} {r['baseline_tflops']:>8.2f}"
        )
    if decode := results.get("decode"):
        print(
            f"\n(b) paged decode: batch {decode['batch']} x {decode['kv_len']} tokens, block {decode['block_size']}, "
            f"{decode['num_splits']} splits: {decode['ms']:.3f} ms, {decode['gbps']:.1f} GB/s of K/V, "
            f"copy {decode['copy_gbps']:.1f} GB/s ({100 * decode['fraction_of_copy']:.1f}% of copy)"
        )
    if (ring_result := results.get("ring")) and "skipped" not in ring_result:
        print(
            f"\n(c) ring attention over {ring_result['devices']} device(s), {ring_result['tokens']} tokens after "
            f"{ring_result['history']} history: {ring_result['ms']:.3f} ms, {ring_result['step_ms']:.3f} ms/step"
        )
    for name in ("chunk", "decode", "ring"):
        if f"{name}_error" in results:
            print(f"\n({name}) failed: {results[f'{name}_error']}")
    if FLAGS.out:
        print(f"\nwrote {FLAGS.out} (after every measurement)")
    if any(k.endswith("_error") for k in results):
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main)
