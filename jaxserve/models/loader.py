"""A model's config, device parameters and tokenizer, by name: drawn for `random:<shape>`, else loaded from a GGUF
file or a Hugging Face folder. The first load converts the source and caches the result on disk (a folder sealed
by disk_cache's manifest); later loads restore it, and a damaged one is moved aside and converted again. A source
that cannot be read is refused with its path and the cause."""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging

from jaxserve import config, disk_cache
from jaxserve.models import quantize, random_weights, registry
from jaxserve.models.config import LlamaConfig
from jaxserve.models.hf_loader import load_hf_dir
from jaxserve.models.llama import param_shapes
from jaxserve.models.tokenizer import TextTokenizer

DTYPES = {name: jnp.dtype(name) for name in config.DTYPES}  # the names config.ModelConfig accepts


def resolve_dtype(name: str) -> str:
    """ModelConfig.dtype as a dtype's name: auto is bfloat16 on an accelerator (vLLM's default there), float32 on
    a CPU (where bfloat16 matmuls are slower)."""
    if name != "auto":
        return name
    return "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"


_CONVERTED_FORMAT = 5  # bump when what _load saves changes, so old caches are not misread
T = TypeVar("T")


def _read_source(source: pathlib.Path, read: Callable[[], T]) -> T:
    """read() of a model file or folder; what it raises becomes one line naming the source and the cause."""
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - a truncated or malformed file raises from deep in its parser
        cause = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ValueError(f"{source}: cannot read the model ({cause})") from e


def load_weights(model: str, dtype: str, quantization: str | None = None) -> tuple[LlamaConfig, Any, TextTokenizer]:
    """Config, device params and tokenizer of `model`: drawn for `random:<shape>` (the same in every process),
    else converted from the file or folder the name resolves to (registry.resolve), or restored from the cache.
    With `quantization` the weights are kept quantized (models/quantize.py): a GGUF file's blocks as stored
    (gguf), or the float weights quantized on the device (int8, int4, fp8). On a CPU where ggml's kernels run, float32
    weights are held as its rows (quantize.float_rows)."""
    if quantization == "gguf":
        source = None if random_weights.is_random(model) else registry.resolve(model)
        if source is None or not source.is_file():
            raise ValueError(f"quantization gguf keeps a .gguf file's blocks; {model} is not a .gguf file")
        cfg, params, tokenizer = _load_gguf_blocks(source, dtype)
    elif random_weights.is_random(model):
        cfg, params, tokenizer = random_weights.load(model, DTYPES[dtype])
    else:
        cfg, params, tokenizer = _load(registry.resolve(model), dtype)
    if quantization and quantization != "gguf":
        params = quantize.quantize_params(params, quantization)
    return cfg, quantize.float_rows(params), tokenizer


def _load_gguf_blocks(source: pathlib.Path, dtype: str) -> tuple[LlamaConfig, Any, TextTokenizer]:
    """A GGUF file's weights with its quantized blocks kept (read from the file's memory map each start: no float
    copy is made, so there is nothing to cache)."""
    from jaxserve.models.gguf_loader import load_gguf

    cfg, host_params, gguf_file = _read_source(source, lambda: load_gguf(source, keep_quantized=True))
    params = jax.tree.map(
        lambda x: quantize.on_device(x, DTYPES[dtype]), host_params, is_leaf=lambda x: isinstance(x, quantize.KEPT)
    )
    return cfg, params, TextTokenizer.from_gguf(gguf_file)


def _converted_dir(source: pathlib.Path, dtype: str) -> pathlib.Path:
    """Cache folder for converted weights, keyed by the identity of every source file that shapes it."""
    files = (
        [source]
        if source.is_file()
        else sorted(f for pattern in ("*.safetensors", "*.json", "*.jinja") for f in source.glob(pattern))
    )
    ident = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    digest = hashlib.sha256(f"{_CONVERTED_FORMAT}|{ident}|{dtype}".encode()).hexdigest()[:16]
    return registry.cache_dir() / "converted" / f"{source.stem}-{dtype}-{digest}"


def _load(source: pathlib.Path, dtype: str) -> tuple[LlamaConfig, Any, TextTokenizer]:
    """Config, device params and tokenizer. The first start converts the source and saves the result (weights
    with orbax, config and tokenizer as JSON); later starts restore it without reading the source again."""
    ckpt_dir = _converted_dir(source, dtype)
    if ckpt_dir.exists():
        restored = _restore(ckpt_dir, dtype)
        if restored is not None:
            return restored
    if source.is_file():
        # imported here: the gguf package is needed only for GGUF files (a GPU image may lack it)
        from jaxserve.models.gguf_loader import load_gguf

        cfg, host_params, gguf_file = _read_source(source, lambda: load_gguf(source))
        tokenizer = _read_source(source, lambda: TextTokenizer.from_gguf(gguf_file))
    else:
        cfg, host_params = _read_source(source, lambda: load_hf_dir(source))
        tokenizer = _read_source(source, lambda: TextTokenizer.from_hf_dir(source))
    params = jax.tree.map(lambda x: jnp.asarray(x, DTYPES[dtype]), host_params)
    if jax.process_count() > 1:
        # orbax's save is a collective over all processes and refuses host-local arrays: each process keeps
        # its own conversion, and a later single-process start fills the cache
        return cfg, params, tokenizer
    _save(ckpt_dir, cfg, params, tokenizer)
    return cfg, params, tokenizer


def _restore(ckpt_dir: pathlib.Path, dtype: str) -> tuple[LlamaConfig, Any, TextTokenizer] | None:
    """The cached conversion, or None when it is not whole (then moved aside, to be converted again)."""
    why = disk_cache.check_manifest(ckpt_dir)
    if why is None:
        try:
            cfg = LlamaConfig.from_json((ckpt_dir / "config.json").read_text())
            here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # each process restores its own copy
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), param_shapes(cfg, DTYPES[dtype])
            )
            params = ocp.StandardCheckpointer().restore(ckpt_dir / "params", abstract)
            return cfg, params, TextTokenizer.load(ckpt_dir)
        except Exception as e:  # noqa: BLE001 - a damaged file raises from deep in orbax or a parser
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    disk_cache.move_aside(ckpt_dir, why)
    return None


def _save(ckpt_dir: pathlib.Path, cfg: LlamaConfig, params: Any, tokenizer: TextTokenizer) -> None:
    """Cache a conversion: written into a folder of this process's own, sealed by its manifest, then renamed into
    place (a start beside this one never sees it half written). A cache that cannot be written is skipped."""
    partial = ckpt_dir.with_name(f"{ckpt_dir.name}.partial-{os.getpid()}")
    try:
        disk_cache.remove(partial)
        partial.mkdir(parents=True)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(partial / "params", params)
        checkpointer.wait_until_finished()
        tokenizer.save(partial)
        (partial / "config.json").write_text(cfg.to_json())
        disk_cache.write_manifest(partial)
        partial.rename(ckpt_dir)
    except Exception as e:  # noqa: BLE001 - a full disk or a read-only folder fails anywhere in orbax's save
        logging.warning("cannot cache the converted weights in %s (%s): serving them from memory", ckpt_dir, e)
    finally:
        disk_cache.remove(partial)  # what is left of a failed save, or a folder another start put in place first
