"""CSA's sharded path (sharding/csa.py) on 8 CPU devices against its single-device reference: SP sizes 1/2/4/8,
GQA 1 and 3, several partition lengths and level / drop configurations, random inputs; and its traffic, read off
the traced program: only ppermutes, carrying exactly the kept K/V that `received_tokens` counts."""

from __future__ import annotations

import jax
import jax.extend as jex
import numpy as np
import pytest

from jaxserve.sharding import csa
from jaxserve.sharding.mesh import make_mesh

D = 16
HEADS = [(8, 8), (24, 8)]  # GQA ratios 1 and 3
EPS32 = float(np.finfo(np.float32).eps)


def levels_for(p: int) -> list[csa.Levels]:
    binary = tuple(2**i for i in range(p.bit_length()))
    configs = [
        csa.Levels(binary, (0,) * len(binary)),
        csa.geometric(binary, 0.5),
        csa.Levels(binary, (0,) + (0.3,) * (len(binary) - 1)),
    ]
    if p >= 4:  # coarser levels: a 4-device "server", then the rest
        configs.append(csa.Levels((1, 4), (0, 0.5)) if p == 4 else csa.Levels((1, 4, 8), (0, 0.5, 0.9)))
    return list(dict.fromkeys(configs))


def inputs(seed, n, h, kvh):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((n, h, D), (n, kvh, D), (n, kvh, D)))
    return q, k, v, rng.random((n, kvh)).astype(np.float32)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("h, kvh", HEADS)
@pytest.mark.parametrize("t", [1, 5, 16])
def test_sharded_matches_reference(devices, p, h, kvh, t):
    """Both sides are float32, in different orders: each within 4 * eps * sqrt(terms) * max |out| of the exact
    value (tests/sharding/test_sp_attention.py's `close`), so within twice that of each other."""
    n = p * t
    q, k, v, imp = inputs([p, h, t], n, h, kvh)
    mesh = make_mesh(devices[:p])
    for levels in levels_for(p):
        want = np.asarray(csa.csa_reference(q, k, v, imp, levels))
        got = np.asarray(csa.csa_attention_sp(mesh, q, k, v, imp, levels=levels))
        np.testing.assert_allclose(
            got, want, rtol=0, atol=8 * EPS32 * np.sqrt(n) * np.abs(want).max(), err_msg=str(levels)
        )


def test_pallas_kernel_inside_shard_map(devices):
    """The chunk-attention kernel in interpret mode for every level (what a GPU runs)."""
    p, h, kvh, t = 4, 6, 2, 16
    q, k, v, imp = inputs([3], p * t, h, kvh)
    levels = csa.geometric((1, 2, 4), 0.5)
    want = np.asarray(csa.csa_reference(q, k, v, imp, levels))
    got = np.asarray(
        csa.csa_attention_sp(make_mesh(devices[:p]), q, k, v, imp, levels=levels, implementation="interpret")
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * EPS32 * np.sqrt(p * t) * np.abs(want).max())


def collectives(jaxpr):
    """(primitive name, params, operand avals) of every collective in a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in (
            "ppermute",
            "all_gather",
            "all_to_all",
            "psum",
            "pmax",
            "reduce_scatter",
            "psum_scatter",
            "all_reduce",
        ):
            found.append((eqn.primitive.name, eqn.params, [x.aval for x in eqn.invars]))
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found += collectives(sub)
    return found


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("h, kvh", HEADS)
def test_traffic_is_only_the_kept_kv(devices, p, h, kvh):
    t = 12
    q, k, v, imp = inputs([p], p * t, h, kvh)
    for levels in levels_for(p):
        jaxpr = jax.make_jaxpr(lambda *a: csa.csa_attention_sp(make_mesh(devices[:p]), *a, levels=levels))(q, k, v, imp)
        found = collectives(jaxpr.jaxpr)
        assert {name for name, _, _ in found} <= {"ppermute"}, found
        moved = sum(len(params["perm"]) * aval.size * aval.dtype.itemsize for _, params, (aval,) in found)
        assert moved == sum(csa.received_tokens(levels, t)) * 2 * kvh * D * 4, levels
