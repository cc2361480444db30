"""Tokenizer from GGUF metadata (BPE vocab + merges through `tokenizers`) or tokenizer.json, and chat templates."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxserve.models.gguf_loader import GGUFFile

_GGUF_CONTROL = 3  # llama.cpp token type of control tokens such as <|im_start|>
_GGUF_USER_DEFINED = 4

# llama.cpp pre-tokenizer names -> the splits they perform before byte-level BPE.
_LLAMA3_PRE = {"llama3", "llama-bpe", "dbrx", "smaug-bpe"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # every digit is its own pre-token
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


class TextTokenizer:
    """Encode/decode text and render the model's chat template."""

    def __init__(self, tokenizer: Tokenizer, *, bos_id: int | None, eos_id: int, add_bos: bool,
                 chat_template: str | None, special_tokens: dict[str, str]):
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "TextTokenizer":
        if f.field("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"{f.path}: unsupported GGUF tokenizer {f.field('tokenizer.ggml.model')!r} (only BPE 'gpt2')")
        tokens: list[str] = f.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges")]
        types: list[int] = f.field("tokenizer.ggml.token_type")
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   byte_fallback=False))
        tok.pre_tokenizer = _gguf_pre_tokenizer(f.field("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
        specials = [t for t, ty in zip(tokens, types) if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = f.field("tokenizer.ggml.bos_token_id")
        eos = int(f.field("tokenizer.ggml.eos_token_id"))
        names = {"eos_token": tokens[eos]}
        if bos is not None:
            names["bos_token"] = tokens[int(bos)]
        return cls(tok, bos_id=None if bos is None else int(bos), eos_id=eos,
                   add_bos=bool(f.field("tokenizer.ggml.add_bos_token", False)),
                   chat_template=f.field("tokenizer.chat_template"), special_tokens=names)

    @classmethod
    def from_hf_dir(cls, root: str | pathlib.Path) -> "TextTokenizer":
        root = pathlib.Path(root)
        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

        def token_text(key: str) -> str | None:
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        names = {k: t for k in ("bos_token", "eos_token") if (t := token_text(k)) is not None}
        if "eos_token" not in names:
            raise ValueError(f"{root}: tokenizer_config.json names no eos_token")
        bos = names.get("bos_token")
        template = cfg.get("chat_template")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        # tokenizer.json's post-processor already adds BOS where the model wants it.
        return cls(tok, bos_id=None if bos is None else tok.token_to_id(bos), eos_id=tok.token_to_id(names["eos_token"]),
                   add_bos=False, chat_template=template, special_tokens=names)

    def save(self, root: pathlib.Path) -> None:
        """Write tokenizer.json + jaxserve_tokenizer.json, so a later start needs neither GGUF nor HF files."""
        self.tokenizer.save(str(root / "tokenizer.json"))
        meta = {"bos_id": self.bos_id, "eos_id": self.eos_id, "add_bos": self.add_bos,
                "chat_template": self.chat_template, "special_tokens": self.special_tokens}
        (root / "jaxserve_tokenizer.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, root: pathlib.Path) -> "TextTokenizer":
        meta = json.loads((root / "jaxserve_tokenizer.json").read_text())
        return cls(Tokenizer.from_file(str(root / "tokenizer.json")), **meta)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content'")
        return _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens
        )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    # The same sandboxed environment settings Hugging Face uses for chat templates.
    if source not in _TEMPLATES:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                          extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
