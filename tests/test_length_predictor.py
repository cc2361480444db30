"""The live side of `--length_predictor=prompt` (cluster/length_predictor.py): the prompt features against the
embedding table read directly, and the classifier's state kept in the cache folder (rebuilt when damaged)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.cluster.length_predictor import KeptClassifier, PromptFeatures, default_path
from jaxserve.models.loader import load_weights
from jaxserve.models.quantize import Quantized
from jaxserve.sched.decode_dispatch import PromptInfo


def _table(params):
    """The embedding table's values (a CPU with ggml holds them as its F32 rows: quantize.float_rows)."""
    table = params["params"]["embed_tokens"]["embedding"]
    return getattr(table, "raw", table)


@pytest.fixture(scope="module")
def params():
    return load_weights("random:tiny", "float32")[1]


@pytest.mark.parametrize("n", [1, 7, 64, 65, 300])
def test_features_are_the_mean_of_the_prompts_embedding_rows(params, n):
    table = np.asarray(_table(params))
    ids = np.random.default_rng(n).integers(0, table.shape[0], n)
    got = PromptFeatures(params)(ids.tolist())
    want = table[ids].mean(0)
    # float32 sums of n rows of magnitude ~|w|: rounding grows with n at most
    assert got.shape == want.shape and np.allclose(
        got, want, rtol=0, atol=4 * n * np.finfo(np.float32).eps * np.abs(table).max()
    )


def test_warmup_compiles_every_size_a_prompt_takes(params):
    features = PromptFeatures(params)
    features.warmup(1000)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    for n in (1, 64, 65, 300, 513, 1000):
        features(list(range(n)))
    assert compiles == []


def test_a_quantized_table_gives_its_dequantized_rows_mean(params):
    kept = load_weights("random:tiny", "float32", "int8")[1]
    assert isinstance(kept["params"]["embed_tokens"]["embedding"], Quantized)
    ids = list(range(5, 90))
    got, full = PromptFeatures(kept)(ids), PromptFeatures(params)(ids)
    scale = np.abs(np.asarray(_table(params))).max()
    assert got.shape == full.shape and np.abs(got - full).max() < scale / 100  # int8: ~1/254 of each row's range


def test_the_classifier_is_kept_in_the_cache_and_a_damaged_file_is_moved_aside(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    path = default_path("some/model.gguf", "float32")
    assert tmp_path in path.parents
    rng = np.random.default_rng(0)
    kept = KeptClassifier(path, 16, save_every=4)
    for _ in range(3):
        kept.observe(PromptInfo(10, rng.normal(size=16)), 100)
    assert not path.exists()  # written every 4
    kept.observe(PromptInfo(10, rng.normal(size=16)), 100)
    again = KeptClassifier(path, 16)
    assert again.classifier.seen == 4 and np.array_equal(again.classifier.weights, kept.classifier.weights)
    path.write_text('{"dim": 16, "weights": [')
    fresh = KeptClassifier(path, 16)
    assert fresh.classifier.seen == 0 and list(path.parent.glob(f"{path.name}.bad-*"))
    other = KeptClassifier(None, 16, save_every=1)  # nowhere: learns in memory only
    other.observe(PromptInfo(10, rng.normal(size=16)), 100)
    assert other.classifier.seen == 1
