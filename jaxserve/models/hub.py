"""Models by Hugging Face Hub id, `org/name[@revision]`, through huggingface_hub.

The files a model needs (config, safetensors weights, tokenizer, chat template) come from the hub's cache
(`HF_HUB_CACHE`, or `HF_HOME`'s `hub/`), fetched first if they are not there. `HF_TOKEN` authorises gated or
private repos; with `HF_HUB_OFFLINE=1` nothing is fetched and only the cache serves. The environment is read at
each call, so a notebook may change it between loads.
"""

from __future__ import annotations

import os
import pathlib
import re

import huggingface_hub
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

# org/name, optionally @revision (a branch, a tag or a commit)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
SKIP = ["consolidated*", "original/*"]  # the same weights in Mistral's and Meta's own layouts


def is_hub_id(model: str) -> bool:
    return bool(HUB_ID.match(model))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def snapshot(model: str) -> pathlib.Path:
    """The local folder of `org/name[@revision]`'s files, fetched into the hub's cache if they are not there.
    ValueError says why not (offline and not cached, no such repo, no access)."""
    repo, _, revision = model.partition("@")
    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
    )
    try:
        path = huggingface_hub.snapshot_download(
            repo,
            revision=revision or None,
            allow_patterns=FILES,
            ignore_patterns=SKIP,
            cache_dir=cache,
            local_files_only=offline(),
            token=os.environ.get("HF_TOKEN") or None,
        )
    except LocalEntryNotFoundError:
        where = "offline (HF_HUB_OFFLINE)" if offline() else "and the hub cannot be reached"
        raise ValueError(
            f"model {model!r} is not in the hub cache {cache or huggingface_hub.constants.HF_HUB_CACHE} {where}"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {model!r}: no such repository on the hub, or it needs a token (HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise ValueError(f"model {model!r}: the hub refused ({e})") from None
    root = pathlib.Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(
            f"model {model!r} has no config.json (only safetensors models are served by hub id; a "
            "GGUF file serves by its path)"
        )
    return root
