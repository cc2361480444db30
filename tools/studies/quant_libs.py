"""qwix against aqtp, the two JAX quantization libraries, for weight-only int8 / int4 serving: what decided
jaxserve's choice (docs/BENCHMARKS.md). Each quantizes a stack of SmolLM2-135M's projections (30 layers of q, k,
v, o, gate, up, down; random weights) through its Flax path, then serves it: bytes the served parameters hold,
milliseconds per forward at batch 1 and 16 (medians of 20), and the error against float32.

    .venv/bin/pip install aqtp   # not a jaxserve dependency
    .venv/bin/python tools/studies/quant_libs.py

qwix: `quantize_model(model, PtqProvider(rules))` and `quantize_params`: the served tree holds the quantized
arrays only. aqtp: `AqtDotGeneral` injected into each nn.Dense, a CONVERT pass that freezes the quantized kernels
into an 'aqt' collection, then SERVE mode; nn.Dense still reads its float 'kernel', so the served tree holds both.
"""

from __future__ import annotations

import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.flax import aqt_flax

E, F, LAYERS = 576, 1536, 30
SHAPES = [(E, E), (E, 192), (E, 192), (E, E), (E, F), (E, F), (F, E)]


class Stack(nn.Module):
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        out = 0.0
        for layer in range(LAYERS):
            for j, (k, n) in enumerate(SHAPES):
                extra = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
                y = nn.Dense(n, use_bias=False, name=f"l{layer}_{j}", **extra)(
                    x if k == E else jnp.tile(x, (1, F // E))
                )
                out = out + y[:, :4].sum()
        return out


def mib(tree) -> float:
    bits = lambda d: 4 if jnp.dtype(d) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)) else 8 * jnp.dtype(d).itemsize  # noqa: E731
    return sum(x.size * bits(x.dtype) for x in jax.tree.leaves(tree)) / 8 / 2**20


def ms(f, *args) -> float:
    f(*args).block_until_ready()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def report(name, f, params, x1, x16, ref):
    err = float(abs(f(params, x16) - ref) / abs(ref))
    print(f"{name:<22}{mib(params):>10.1f}{ms(f, params, x1):>10.2f}{ms(f, params, x16):>10.2f}{err:>12.2e}")


def main():
    x1, x16 = (jax.random.normal(jax.random.key(b), (b, E)) for b in (1, 16))
    model = Stack()
    params = model.init(jax.random.key(0), x1)
    f = jax.jit(model.apply)
    ref = f(params, x16)
    print(f"jax {jax.__version__} {jax.devices()[0].platform}")
    print(f"{'':<22}{'MiB':>10}{'b1 ms':>10}{'b16 ms':>10}{'rel. error':>12}")
    report("float32", f, params, x1, x16, ref)
    for qtype, tile in (("int8", None), ("int4", 32)):
        rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=qtype, tile_size=tile)]
        qmodel = qwix.quantize_model(model, qwix.PtqProvider(rules))
        qparams = qwix.quantize_params(params, jax.eval_shape(qmodel.init, jax.random.key(0), x1))
        report(f"qwix {qtype}", jax.jit(qmodel.apply), qparams, x1, x16, ref)
    rngs = {"params": jax.random.key(1)}
    for bits in (8, 4):
        cfg = aqt_config.dot_general_make(lhs_bits=None, rhs_bits=bits)
        mode = functools.partial(
            aqt_flax.AqtDotGeneral,
            cfg,
            lhs_quant_mode=aqt_flax.QuantMode.TRAIN,
            rhs_freeze_mode=aqt_flax.FreezerMode.CALIBRATION_AND_VALUE,
        )
        _, converted = Stack(functools.partial(mode, rhs_quant_mode=aqt_flax.QuantMode.CONVERT)).apply(
            params, x1, mutable=True, rngs=rngs
        )
        serve = Stack(functools.partial(mode, rhs_quant_mode=aqt_flax.QuantMode.SERVE))
        served = {"aqt": converted["aqt"], "params": params["params"]}  # SERVE still reads nn.Dense's float kernel
        report(f"aqtp int{bits}", jax.jit(functools.partial(serve.apply, rngs=rngs)), served, x1, x16, ref)


if __name__ == "__main__":
    main()
