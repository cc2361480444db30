"""Cost models: the Tetris Eq. (1) fit against Tetris Table 1, exact recovery, JSON round trips, no jax."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jaxserve.sched import cost_models as cm
from jaxserve.sched.profiles import tetris_table1_samples


def test_tetris_eq1_reproduces_table1_within_10_percent():
    model = cm.TetrisPrefill.fit(tetris_table1_samples())
    for sp, (n, h), t in tetris_table1_samples():
        assert abs(model.predict(sp, n, h) - t) / t < 0.10, (sp, n, t, model.predict(sp, n, h))


@pytest.mark.parametrize(
    "model_cls, key, inputs, true",
    [
        (cm.TetrisPrefill, 8, lambda r: (r.integers(1, 9000), r.integers(0, 50000)), [0.1, 2e-5, 3e-10, 1e-9]),
        (cm.LoongServePrefill, (4, 2), lambda r: (r.integers(1, 9000), r.integers(1, 9000) ** 2), [0.05, 1e-5, 2e-10]),
        (cm.Decode, (1, 8), lambda r: (r.integers(1, 64), r.integers(1, 10**6)), [0.01, 2e-4, 3e-9]),
        (cm.LinkModel, "nvlink", lambda r: (r.integers(1, 10**9),), [2e-5, 1 / 2e11]),
    ],
)
def test_fit_recovers_exact_coefficients_and_round_trips(model_cls, key, inputs, true):
    rng = np.random.default_rng(0)
    xs = [inputs(rng) for _ in range(40)]
    samples = [(key, x, float(model_cls.features(*x) @ np.asarray(true))) for x in xs]
    model = model_cls.fit(samples)
    np.testing.assert_allclose(model.coef(key), true, rtol=1e-6)
    again = model_cls.from_json(model.to_json())
    np.testing.assert_array_equal(again.coef(key), model.coef(key))
    with pytest.raises(KeyError, match="no fit"):
        model.coef("missing")


def test_json_kind_is_checked():
    with pytest.raises(ValueError, match="expected a decode model"):
        cm.Decode.from_json(cm.LinkModel.fit([("l", (1,), 1.0), ("l", (2,), 2.0)]).to_json())


def test_too_few_samples_is_an_error():
    with pytest.raises(ValueError, match="cannot fit"):
        cm.TetrisPrefill.fit([(1, (1000, 0), 0.1), (1, (2000, 0), 0.2)])


def test_sched_never_imports_jax():
    code = "import sys, jaxserve.sched.cost_models; assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
