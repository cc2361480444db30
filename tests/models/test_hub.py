"""Models by Hugging Face Hub id, from a folder laid out as the hub's cache (no network: HF_HUB_OFFLINE)."""

from __future__ import annotations

import pathlib

import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.models import registry
from jaxserve.models.hub import is_hub_id
from tiny_models import smollm2_tokenizer, write_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> pathlib.Path:
    """acme/tiny in a hub cache: refs/main names a commit whose snapshot holds the files."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    write_tiny_model(snapshot, smollm2_tokenizer())
    return cache


@pytest.fixture
def offline(hub_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))  # weights converted afresh
    return hub_cache


def test_hub_ids_are_told_from_names_and_paths():
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("acme/tiny@v1.0") and is_hub_id("a/b@" + COMMIT)
    assert not is_hub_id("smollm2-135m-instruct") and not is_hub_id("/models/x") and not is_hub_id("a/b/c")


def test_a_hub_id_serves_the_cached_snapshot_offline(offline):
    snapshot = offline / "models--acme--tiny" / "snapshots" / COMMIT
    assert registry.resolve("acme/tiny") == snapshot == registry.resolve(f"acme/tiny@{COMMIT}")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    by_id = jaxserve.LLM("acme/tiny", max_model_len=64, kv_cache_tokens=256, progress=False)
    by_path = jaxserve.LLM(str(snapshot), max_model_len=64, kv_cache_tokens=256, progress=False)
    assert by_id.generate("Hello there", params)[0].token_ids == by_path.generate("Hello there", params)[0].token_ids


@pytest.mark.parametrize(
    "model, message",
    [
        ("acme/missing", "not in the hub cache"),
        ("acme/tiny@v9", "not in the hub cache"),
    ],
)
def test_a_model_the_cache_lacks_offline_is_refused_by_name(offline, model, message):
    with pytest.raises(ValueError, match=message):
        jaxserve.LLM(model, progress=False)
