"""What bounds decode and prefill on this CPU: memory bandwidth, and XLA's matmuls against PyTorch's.

    .venv/bin/pip install -e '.[reference]'
    .venv/bin/python tools/bench/cpu_bounds.py [--model=smollm2-135m-instruct] [--out=bench_out/cpu_bounds.json]

A decode step reads every weight once: at batch 1 its time is at least the weights' bytes over the rate at which
memory is read. Two measures of that rate: a one-row matmul over the model's largest matrix (the logits'), and a
plain sum over as many bytes as the weights, each the faster of JAX and PyTorch. Batch 16 and prefill are matmuls
of 16 and 1,024 rows: their time is at least their FLOPs over the matmul rate. The tool times the model's own
projection shapes (in float32, on all threads) in JAX (XLA's CPU backend, as the engine runs them) and in PyTorch
(what transformers runs), side by side, and prints the batch-1 bounds in tokens/s. Medians of 20 after a warm-up.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jaxserve
from jaxserve.engine import profile
from jaxserve.models import registry

FLAGS = flags.FLAGS
flags.DEFINE_string("model", registry.DEFAULT_MODEL, "Registered model name or path (GGUF).")
flags.DEFINE_integer("repeats", 20, "Timed repetitions; the median is reported.")
flags.DEFINE_string("out", None, "Optional JSON file for the results.")


def matmul_rates(m: int, k: int, n: int, repeats: int) -> tuple[float, float]:
    """FLOP/s of an [m, k] x [k, n] float32 matmul in JAX and in PyTorch (a Linear's weight layout)."""
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    matmul = jax.jit(jnp.matmul)
    t_jax = profile.median_time(lambda: matmul(ja, jb).block_until_ready(), repeats)
    ta, tw = torch.from_numpy(a), torch.from_numpy(np.ascontiguousarray(b.T))
    with torch.no_grad():
        t_torch = profile.median_time(lambda: torch.nn.functional.linear(ta, tw), repeats)
    flops = 2 * m * k * n
    return flops / t_jax, flops / t_torch


def read_rates(nbytes: int, repeats: int) -> tuple[float, float]:
    """Bytes/s at which JAX and PyTorch (all threads) sum a float32 array of nbytes: what memory gives a reader."""
    import torch

    x = np.random.default_rng(0).standard_normal(nbytes // 4, np.float32)
    jx, total = jnp.asarray(x), jax.jit(jnp.sum)
    t_jax = profile.median_time(lambda: total(jx).block_until_ready(), repeats)
    t_torch = profile.median_time(lambda: torch.from_numpy(x).sum(), repeats)
    return nbytes / t_jax, nbytes / t_torch


def main(argv: list[str]) -> None:
    del argv
    import torch

    cfg = jaxserve.LLM(FLAGS.model, kv_cache_tokens=256, progress=False).config  # the config; a small KV pool
    e, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    layer = e * (cfg.num_heads * cfg.head_dim) * 2 + 2 * e * kv + 3 * e * f  # q, o, k, v, gate, up, down
    weight_bytes = 4 * (cfg.num_layers * layer + cfg.vocab_size * e)  # the layers and the logits' matrix
    jax_rate, torch_rate = matmul_rates(1, e, cfg.vocab_size, FLAGS.repeats)
    bandwidth = max(jax_rate, torch_rate) / 2 * 4  # one multiply-add per float32 weight read
    results = {
        "model": FLAGS.model,
        "jax": jax.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes,
        "gemv_read_gb_s": bandwidth / 1e9,
        "batch1_bound_tok_s": bandwidth / weight_bytes,
        "matmuls": [],
    }
    print(f"jax {jax.__version__}, torch {torch.__version__} ({results['threads']} threads); {FLAGS.model}")
    print(
        f"a one-row matmul reads {bandwidth / 1e9:.1f} GB/s; {weight_bytes / 1e6:.0f} MB of float32 weights a token: "
        f"batch-1 decode at most {bandwidth / weight_bytes:.1f} tok/s"
    )
    jax_read, torch_read = read_rates(weight_bytes, FLAGS.repeats)
    results |= {"sum_read_gb_s": {"jax": jax_read / 1e9, "torch": torch_read / 1e9}}
    print(
        f"a sum over as many bytes reads {jax_read / 1e9:.1f} GB/s (JAX), {torch_read / 1e9:.1f} GB/s (PyTorch): "
        f"at that rate batch-1 decode would reach {max(jax_read, torch_read) / weight_bytes:.1f} tok/s"
    )
    print(f"{'rows':>6} {'k':>6} {'n':>6} {'jax GFLOP/s':>12} {'torch GFLOP/s':>14} {'jax/torch':>10}")
    for m in (1, 16, 1024):
        for k, n in ((e, f), (f, e), (e, e)):
            jax_rate, torch_rate = matmul_rates(m, k, n, FLAGS.repeats)
            results["matmuls"].append(dict(rows=m, k=k, n=n, jax_gflops=jax_rate / 1e9, torch_gflops=torch_rate / 1e9))
            print(
                f"{m:>6} {k:>6} {n:>6} {jax_rate / 1e9:>12.1f} {torch_rate / 1e9:>14.1f} {jax_rate / torch_rate:>9.2f}x"
            )
    if FLAGS.out:
        with open(FLAGS.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
