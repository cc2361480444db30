"""Compile jaxserve's programs for GPUs that are not here, and read what was compiled: does every ring transfer of
K/V overlap attention? Does the serving step copy weights or branch?

    .venv/bin/python tools/checks/gpu_compile.py --out=bench_out/gpu_compile
    .venv/bin/python tools/checks/gpu_compile.py --decode --out=bench_out/gpu_decode

Needs JAX's CUDA plugin but no GPU and no CUDA libraries: tools/install.sh puts the plugin matching the installed
jaxlib in .venv/cuda-compiler, outside the venv's own packages so that nothing else starts it, and this script
puts that folder on its path (and skips the plugin's check of CUDA libraries, which it does not use). The compile is
deviceless: `jax.experimental.topologies` describes --sp GPUs of the --gpu (tools/checks/gpu_targets/*.pbtxt) on one
host, and XLA's GPU compiler (Triton kernels included) runs as it would on them, with the XLA flags the launcher
sets on GPU (xla_flags.GPU_XLA_FLAGS; --nolauncher_flags compiles without them).

Programs:
- ring: one layer's ring attention (`sharding.ring.ring_attention`: history + chunk) over the SP group;
- chunk: the CDSP chunk step of the engine (`engine.sp_prefill.chunk_step`) for a Llama-3.1-8B-shaped model with
  --layers layers, bf16, the Pallas kernels.

For each collective-permute the report gives its bytes, whether XLA made it asynchronous, and the attention
kernels (Pallas/Triton calls, counting those inside loops) scheduled while it is in flight. The compiled HLO of
each program and a JSON summary go to --out. Exit status 1 if a K/V transfer overlaps no kernel.

--decode instead compiles the engine's pure-decode serving step for one GPU at batch 1 and 16, as the runner
compiles it: its forward (engine.runner.forward_packed: Llama-3.1-8B's 32 layers, bf16, the Pallas kernels) as
`decode_b1.hlo` and `decode_b16.hlo`, its sampler (engine.runner.sample_padded, of each kind: greedy, a draw, a
draw cut by top-k / top-p), and its multi-step decode (engine.runner.burst_packed: the forward and the greedy
sampler in one device loop) as `burst_b1.hlo` and `burst_b16.hlo`. The summary counts, per program, the compile
seconds, the `conditional`s (each makes the host wait for the device), the `while` loops, and the weight copies:
instructions outside fusions whose result has a weight's shape (a layer scan's dynamic slice of the stacked weights
is one; with --quantization, a dequantized weight written out is one too), and the scatters that read a weight (a
projection fused into the KV write). Exit status 1 if any is found.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from typing import Any
from unittest import mock

PLUGIN = pathlib.Path(sys.prefix) / "cuda-compiler"
if PLUGIN.is_dir():  # before JAX looks for plugins; the plugin's check of CUDA libraries would fail without them
    sys.path.insert(0, str(PLUGIN))
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import numpy as np  # noqa: E402

from jaxserve import xla_flags  # noqa: E402
from jaxserve.engine import batch, compiled, sp_prefill  # noqa: E402
from jaxserve.engine.kv_cache import RaggedPagedBackend  # noqa: E402
from jaxserve.engine.runner import burst_packed, forward_packed, sample_padded  # noqa: E402
from jaxserve.models.config import llama3_8b  # noqa: E402
from jaxserve.models.llama import Llama, param_shapes  # noqa: E402
from jaxserve.models import quantize  # noqa: E402
from jaxserve.models.quantize import quantize_params  # noqa: E402
from jaxserve.sharding import overlap, ring  # noqa: E402
from jaxserve.sharding.mesh import SP, make_mesh  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("sp", 8, "GPUs in the SP group.")
flags.DEFINE_string("gpu", "h100", "GPU description: tools/checks/gpu_targets/<gpu>.pbtxt.")
flags.DEFINE_bool("launcher_flags", True, "Compile with the XLA flags the launcher sets on GPU.")
flags.DEFINE_list("programs", ["ring", "chunk"], "Programs to compile: ring, chunk.")
flags.DEFINE_integer("tokens", 8192, "Chunk tokens over the whole group.")
flags.DEFINE_integer("history", 8192, "History tokens held by the group (over all devices).")
flags.DEFINE_integer("layers", 2, "Layers of the chunk program's model.")
flags.DEFINE_string("out", "bench_out/gpu_compile", "Folder for the compiled HLO and summary.json.")
flags.DEFINE_bool("decode", False, "Compile the pure-decode serving step on one GPU instead (batch 1 and 16).")
flags.DEFINE_integer("decode_layers", 32, "Layers of the decode step's model (Llama-3.1-8B has 32).")
flags.DEFINE_string("quantization", None, "The decode step's weights kept quantized (int8, int4, fp8).")

TARGETS = pathlib.Path(__file__).parent / "gpu_targets"
KV_MIN_BYTES = 1 << 16  # smaller transfers (positions, scalars) are not the ring's K/V


def gpu_mesh(n: int, gpu: str) -> jax.sharding.Mesh:
    config = (TARGETS / f"{gpu}.pbtxt").read_text()
    devices = topologies.get_topology_desc("jaxserve", "cuda", target_config=config, topology=f"1x1x{n}").devices
    return make_mesh(devices)


def ring_program(mesh: jax.sharding.Mesh) -> tuple[Any, tuple]:
    n = mesh.shape[SP]
    cfg = llama3_8b()
    h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def body(q, k, v, q_pos, k_pos, hist_k, hist_v, hist_pos):
        return ring.ring_attention(
            q, k, v, q_pos, k_pos, hist_k, hist_v, hist_pos, axis_size=n, implementation="kernel"
        )

    spec = P(SP)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 8, out_specs=(spec, spec), check_vma=False))
    arg = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    t, s = FLAGS.tokens, FLAGS.history
    return step, (
        arg((t, h, d), jnp.bfloat16),
        arg((t, kvh, d), jnp.bfloat16),
        arg((t, kvh, d), jnp.bfloat16),
        arg((t,), jnp.int32),
        arg((t,), jnp.int32),
        arg((s, kvh, d), jnp.bfloat16),
        arg((s, kvh, d), jnp.bfloat16),
        arg((s,), jnp.int32),
    )


def chunk_program(mesh: jax.sharding.Mesh) -> tuple[Any, tuple]:
    cfg = llama3_8b(FLAGS.layers)
    shapes = param_shapes(cfg, jnp.bfloat16)
    specs = jax.tree.map(lambda _: P(), shapes)  # tp = 1: every instance holds the whole model
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), shapes)
    key_block = 512
    step = sp_prefill.chunk_step(cfg, mesh, specs, key_block=key_block, dtype=jnp.bfloat16, implementation="kernel")
    n = mesh.shape[SP]
    cap = -(-FLAGS.history // n // key_block) * key_block
    store = (cfg.num_layers, cap, cfg.num_kv_heads, cfg.head_dim)
    return step, (params, *sp_prefill.chunk_args(mesh, FLAGS.tokens // n, cap, store, jnp.bfloat16))


PROGRAMS = {"ring": ring_program, "chunk": chunk_program}

DECODE_ROWS = (1, 16)
BLOCK, KEY_BLOCK = 16, 256
DECODE_BUCKETS = batch.Buckets.make(
    512,
    16,
    2048,
    BLOCK,
    KEY_BLOCK,
    num_scheduler_steps=8,  # 2,048-token context
    min_decode_rows=2,
)  # as the engine builds them on a GPU
MAX_ROWS = max(s.rows for s in DECODE_BUCKETS.programs())  # the runner's max_rows: every sampler's output


def decode_weights() -> tuple[Any, list[tuple[int, ...]]]:
    """The decode step's weights (--quantization: as a GPU keeps them, 4-bit values as XLA's int4, though the
    default backend here is a CPU), and the float weights' shapes, which a dequantized copy has too."""
    shapes = param_shapes(llama3_8b(FLAGS.decode_layers), jnp.bfloat16, unrolled=True)
    weights = [x.shape for x in jax.tree.leaves(shapes) if len(x.shape) > 1]
    if FLAGS.quantization:
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            shapes = jax.eval_shape(functools.partial(quantize_params, method=FLAGS.quantization), shapes)
    return shapes, weights


def decode_program(mesh: jax.sharding.Mesh, rows: int, shapes: Any, burst: bool = False) -> tuple[Any, tuple]:
    """The engine's pure-decode step of `rows` rows (block size 16, key block 256, a 2,048-token context) over
    weights of `shapes`, or its multi-step decode (`burst`: greedy)."""
    cfg = llama3_8b(FLAGS.decode_layers)
    bs, buckets = BLOCK, DECODE_BUCKETS
    model = Llama(cfg, RaggedPagedBackend(bs, KEY_BLOCK, 1, "kernel"), jnp.bfloat16, unrolled=True)
    here = NamedSharding(mesh, P())
    on_gpu = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), tree
    )
    params = on_gpu(shapes)
    cache = jax.ShapeDtypeStruct(
        (cfg.num_layers, 1025 * bs, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16, sharding=here
    )
    shape = buckets.decode(buckets.fit_decode(rows))  # batch 1 runs in the engine's smallest decode program
    blob = on_gpu(batch.to_blob(batch.empty(buckets, shape, bs)))
    previous = on_gpu(np.zeros(MAX_ROWS, np.int32))  # the last step's sampled tokens, fed on the device
    if burst:
        step = jax.jit(
            functools.partial(burst_packed(model, buckets, bs, MAX_ROWS), slots=None, shape=shape, kind="greedy"),
            donate_argnums=(1,),
        )
    else:
        step = jax.jit(functools.partial(forward_packed(model, buckets), shape=shape), donate_argnums=(1,))
    return step, (params, (cache, cache), blob, previous)


def sampler_program(mesh: jax.sharding.Mesh, rows: int, kind: str) -> tuple[Any, tuple]:
    """The engine's sampler over `rows` rows of Llama-3.1-8B's logits."""
    here = NamedSharding(mesh, P())
    rows = DECODE_BUCKETS.fit_decode(rows)
    logits = jax.ShapeDtypeStruct((rows, llama3_8b(1).vocab_size), jnp.float32, sharding=here)
    arrays = batch.empty(DECODE_BUCKETS, DECODE_BUCKETS.decode(rows), BLOCK)
    sampling = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), batch.sampling(arrays))
    return jax.jit(functools.partial(sample_padded, slots=None, mask=None, kind=kind, size=MAX_ROWS)), (
        logits,
        sampling,
    )


def compile_decode(out: pathlib.Path, options: dict) -> bool:
    mesh = gpu_mesh(1, FLAGS.gpu)
    shapes, weights = decode_weights()
    # as the runner compiles every program of a block-quantized model
    options = options | (quantize.UNMERGED_DOTS if quantize.has_blocks(shapes) else {})
    summary: dict[str, Any] = {
        "gpu": FLAGS.gpu,
        "layers": FLAGS.decode_layers,
        "jax": jax.__version__,
        "quantization": FLAGS.quantization,
        "compiler_options": options,
    }
    ok = True
    for rows in DECODE_ROWS:
        for name in ("decode", "burst"):
            step, args = decode_program(mesh, rows, shapes, burst=name == "burst")
            start = time.perf_counter()
            hlo = step.lower(*args).compile(compiler_options=options).as_text()
            seconds = time.perf_counter() - start
            (out / f"{name}_b{rows}.hlo").write_text(hlo)
            found = compiled.read_step(hlo, weights) | {"compile_seconds": round(seconds, 1)}
            summary[f"{name}_b{rows}"] = found
            print(
                f"{name}_b{rows}: compiled in {seconds:.1f} s; {found['conditionals']} conditionals, "
                f"{found['whiles']} while loops, {len(found['weight_copies'])} weight copies, "
                f"{len(found['scatters_reading_weights'])} scatters reading a weight"
            )
            ok &= not (found["conditionals"] or found["weight_copies"] or found["scatters_reading_weights"])
        for kind in batch.SAMPLER_KINDS:
            step, args = sampler_program(mesh, rows, kind)
            found = compiled.read_step(step.lower(*args).compile(compiler_options=options).as_text(), [])
            summary[f"sampler_b{rows}_{kind}"] = found
            print(f"sampler_b{rows} ({kind}): {found['conditionals']} conditionals")
            ok &= not found["conditionals"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return ok


def main(argv: list[str]) -> None:
    del argv
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    if FLAGS.decode:
        options = xla_flags.compiler_options() if FLAGS.launcher_flags else {}
        if not compile_decode(out, options):
            raise SystemExit(f"a decode program branches on the device or copies weights; see {out}")
        return
    mesh = gpu_mesh(FLAGS.sp, FLAGS.gpu)
    options = xla_flags.compiler_options() if FLAGS.launcher_flags else {}
    summary: dict[str, Any] = {
        "gpu": FLAGS.gpu,
        "sp": FLAGS.sp,
        "tokens": FLAGS.tokens,
        "history": FLAGS.history,
        "layers": FLAGS.layers,
        "jax": jax.__version__,
        "compiler_options": options,
    }
    failed = False
    for name in FLAGS.programs:
        step, args = PROGRAMS[name](mesh)
        hlo = step.lower(*args).compile(compiler_options=options).as_text()
        (out / f"{name}.hlo").write_text(hlo)
        found = overlap.transfers(hlo)
        kv = [t for t in found if t.bytes >= KV_MIN_BYTES]
        summary[name] = [dataclasses.asdict(t) | {"overlapped": t.overlapped} for t in found]
        print(
            f"{name}: {len(found)} collective-permutes, {len(kv)} of K/V size; "
            f"{sum(t.overlapped for t in kv)} of those overlap attention"
        )
        for t in kv:
            print(
                f"  {t.name:32s} {t.bytes / 2**20:8.2f} MiB  {'async' if t.asynchronous else 'sync '}  "
                f"kernels in flight: {t.kernels_in_flight}  ({t.computation})"
            )
        failed |= not kv or not all(t.overlapped for t in kv)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if failed:
        raise SystemExit(f"a K/V transfer overlaps no attention kernel (or none was found); see {out}")


if __name__ == "__main__":
    app.run(main)
