"""Nothing on disk wedges a start (issue 57): each cached artifact damaged in a temporary cache is moved aside and
rebuilt from the source (the weights then restore equal to the source's, and the next start finds it whole); a
damaged model file is refused in one line naming it and the cause; a cache that cannot be written is skipped."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxserve
from jaxserve import SamplingParams, disk_cache
from jaxserve.engine import profile
from jaxserve.models import loader
from tiny_models import gguf_tensors, smollm2_tokenizer, write_gguf, write_tiny_model

TEXT = "The capital of France is"
GGUF_META = {
    "embedding_length": 64,
    "feed_forward_length": 128,
    "block_count": 2,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "context_length": 4096,
    "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-5,
}


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    """A tiny model's folder, and its tensors."""
    root = tmp_path_factory.mktemp("model")
    return root, write_tiny_model(root, tokenizer)


@pytest.fixture(scope="module")
def pristine(model, tmp_path_factory):
    """A cache holding the model's conversion, and what it restores."""
    cache = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_CACHE", str(cache))
        loader.load_weights(str(model[0]), "float32")
        return cache, loader.load_weights(str(model[0]), "float32")


def conversions(cache: pathlib.Path) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """The cache's converted folders, and those moved aside."""
    folders = sorted((cache / "converted").iterdir())
    return [f for f in folders if ".bad-" not in f.name], [f for f in folders if ".bad-" in f.name]


def largest(folder: pathlib.Path) -> pathlib.Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: pathlib.Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i : i + 64] = bytes(b ^ 0x5A for b in data[i : i + 64])
    path.write_bytes(bytes(data))


DAMAGE = {
    "weights truncated": lambda d: truncate(largest(d / "params")),
    "weights bit-flipped": lambda d: flip(largest(d / "params")),
    "orbax metadata garbage": lambda d: (d / "params" / "_METADATA").write_text("{not json"),
    "orbax manifest deleted": lambda d: (d / "params" / "manifest.ocdbt").unlink(),
    "manifest deleted": lambda d: (d / disk_cache.MANIFEST).unlink(),
    "manifest garbage": lambda d: (d / disk_cache.MANIFEST).write_text("\x00\x01"),
    "config truncated": lambda d: truncate(d / "config.json"),
    "tokenizer truncated": lambda d: truncate(d / "tokenizer.json"),
    "tokenizer metadata truncated": lambda d: truncate(d / "jaxserve_tokenizer.json"),
    "a stray file": lambda d: (d / "params" / "stray").write_bytes(b"x"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_conversion_is_moved_aside_and_rebuilt(model, pristine, damage, tmp_path, monkeypatch):
    cache, (cfg, want, tok) = pristine
    shutil.copytree(cache, tmp_path / "cache")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    (folder,), _ = conversions(tmp_path / "cache")
    DAMAGE[damage](folder)
    for _ in range(2):  # rebuilt from the source, then restored from the rebuilt cache
        got_cfg, got, got_tok = loader.load_weights(str(model[0]), "float32")
        assert got_cfg == cfg and got_tok.encode(TEXT) == tok.encode(TEXT)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
        (whole,), aside = conversions(tmp_path / "cache")
        assert disk_cache.check_manifest(whole) is None and len(aside) == 1  # moved aside once, kept


def test_a_bad_cached_profile_is_measured_again_and_the_users_own_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "cache" / "profiles" / "p.json"
    read = lambda: json.loads(path.read_text())["cost"]  # noqa: E731
    for bad in ("{not json", '{"other": 1}', ""):
        disk_cache.write_text(path, bad)
        assert profile.cached(path, read, lambda: 7, lambda c: json.dumps({"cost": c})) == 7
        assert read() == 7  # measured again and written
    assert len(list(path.parent.glob("p.json.bad-*"))) == 3
    own = tmp_path / "mine.json"  # --cost_profile: the user's file is never moved
    own.write_text("{not json")
    with pytest.raises(ValueError, match="mine.json"):
        profile.cached(own, lambda: json.loads(own.read_text()), lambda: 7, json.dumps)
    assert own.read_text() == "{not json"


def test_a_cache_that_cannot_be_written_is_skipped(model, pristine, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JAXSERVE_CACHE", str(blocker / "cache"))  # no folder can be made under a file
    _, (cfg, want, _) = pristine
    got_cfg, got, _ = loader.load_weights(str(model[0]), "float32")
    assert got_cfg == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
    path = blocker / "cache" / "profiles" / "p.json"
    assert profile.cached(path, lambda: json.loads(path.read_text()), lambda: 7, json.dumps) == 7


def _copy(model: pathlib.Path, where: pathlib.Path) -> pathlib.Path:
    shutil.copytree(model, where)
    return where


def test_a_damaged_model_file_is_refused_with_its_path_and_the_cause(model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    root, tensors = model
    cases = []
    cut = _copy(root, tmp_path / "cut")
    truncate(cut / "model.safetensors")
    cases.append((cut / "model.safetensors", cut))
    header = _copy(root, tmp_path / "header")
    flip(header / "model.safetensors", at=0.0)
    cases.append((header / "model.safetensors", header))
    gguf = tmp_path / "model.gguf"
    write_gguf(gguf, "llama", GGUF_META, gguf_tensors(tensors, "llama"), tokenizer, pre="smollm")
    for name, damage in (("cut.gguf", truncate), ("header.gguf", lambda p: flip(p, at=0.0))):
        shutil.copy(gguf, tmp_path / name)
        damage(tmp_path / name)
        cases.append((tmp_path / name, tmp_path / name))
    for path, source in cases:
        with pytest.raises(ValueError, match=f"^{source}: cannot read the model") as e:
            loader.load_weights(str(source), "float32")
        assert "\n" not in str(e.value), path
    assert not (tmp_path / "cache" / "converted").exists() or not any((tmp_path / "cache" / "converted").iterdir())


def test_weights_that_are_not_finite_are_refused_by_tensor_name(model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    nan = _copy(model[0], tmp_path / "nan")
    tensors = load_file(str(nan / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, :5] = np.nan
    save_file(tensors, str(nan / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor model.layers.1.mlp.up_proj.weight holds 5 values that are not"):
        loader.load_weights(str(nan), "float32")
    tensors = dict(model[1], **{"model.norm.weight": np.full(64, np.inf, np.float32)})
    write_gguf(tmp_path / "inf.gguf", "llama", GGUF_META, gguf_tensors(tensors, "llama"), tokenizer, pre="smollm")
    with pytest.raises(ValueError, match="inf.gguf: .*tensor model.norm.weight holds 64 values that are not"):
        loader.load_weights(str(tmp_path / "inf.gguf"), "float32")


@contextlib.contextmanager
def xla_cache_in(folder: pathlib.Path):
    """The process's XLA cache in `folder`, every program kept. JAX takes its cache folder at the first compile
    of the process, so an earlier test's LLM would otherwise have fixed it elsewhere."""
    from jax.experimental.compilation_cache import compilation_cache  # public: the folder moves on reset

    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()


@pytest.fixture
def own_xla_cache(tmp_path):
    with xla_cache_in(tmp_path / "xla"):
        yield


def test_serving_from_a_cache_that_cannot_be_written_gives_the_same_text(model, tmp_path, monkeypatch):
    """serve's start (every program compiled, the cost profile measured) with a cache folder in which nothing
    can be made (a file stands where it should be; a read-only folder would not stop root): the weights, the
    profile and the compiled programs are not kept, and it serves what a writable cache does."""
    settings = dict(max_model_len=128, kv_cache_tokens=512, max_num_seqs=2, progress=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "writable"))
    with xla_cache_in(tmp_path / "writable" / "xla"):
        want = jaxserve.LLM(str(model[0]), **settings).generate(TEXT, params)[0].token_ids
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JAXSERVE_CACHE", str(blocker / "cache"))
    with xla_cache_in(blocker / "cache" / "xla"):
        llm = jaxserve.LLM(str(model[0]), warmup=True, **settings)
        assert llm.generate(TEXT, params)[0].token_ids == want
    assert blocker.is_file()


def test_the_second_start_after_every_cache_is_damaged_serves_the_same_text(
    model, tmp_path, monkeypatch, own_xla_cache
):
    """The converted weights, the cost profiles and the compiled programs all damaged: the next start serves
    what the first did, and so does the one after."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = jaxserve.LLM(str(model[0]), max_model_len=128, kv_cache_tokens=512, max_num_seqs=2, progress=False)
    want = first.generate(TEXT, params)[0].token_ids
    del first
    damaged = [largest(conversions(tmp_path)[0][0] / "params")]
    damaged += [p for kind in ("profiles", "xla") for p in (tmp_path / kind).rglob("*") if p.is_file()]
    assert any("xla" in p.parts for p in damaged)
    for p in damaged:
        flip(p)
    for _ in range(2):
        llm = jaxserve.LLM(str(model[0]), max_model_len=128, kv_cache_tokens=512, max_num_seqs=2, progress=False)
        assert llm.generate(TEXT, params)[0].token_ids == want
        del llm
