"""Tokenizer from GGUF metadata (byte-level BPE vocab + merges, or a SentencePiece vocab + scores, through
`tokenizers`) or tokenizer.json, and chat templates."""

from __future__ import annotations

import functools
import json
import pathlib
import re
import secrets
from typing import TYPE_CHECKING, Any, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

if TYPE_CHECKING:  # gguf is imported only where a GGUF file is read
    from jaxserve.models.gguf_loader import GGUFFile

_GGUF_UNKNOWN = 2  # llama.cpp token types: <unk>
_GGUF_CONTROL = 3  # control tokens such as <|im_start|>
_GGUF_USER_DEFINED = 4
# tokens llama.cpp ends generation at by their text (Gemma's files name no end-of-turn id); not <|endoftext|>,
# which llama.cpp adds too but which transformers' generation configs leave out (SmolLM2's)
END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")

# llama.cpp pre-tokenizer names -> the splits they perform before byte-level BPE (the names transformers maps).
_LLAMA3_PRE = {
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "dbrx",
    "smaug-bpe",
}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


_GPT2_PRE = {None, "default", "gpt2", "gpt-2"}
# llama.cpp's qwen2 pre-tokenizer: Llama-3's, but every digit on its own
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"}
# Qwen3.5's: Qwen2's, with combining marks inside words
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Mistral's tekken (Nemo, Pixtral 12B): cased words, every digit alone
_TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (Llama 4 and others): cased words with their contractions, digits in threes
_GPT4O_PRE = {"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **{p: _LLAMA3_REGEX for p in _LLAMA3_PRE},
    **{p: _QWEN2_REGEX for p in _QWEN2_PRE},
    **{p: _GPT4O_REGEX for p in _GPT4O_PRE},
    "qwen35": _QWEN35_REGEX,
    "tekken": _TEKKEN_REGEX,
}


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # every digit is its own pre-token
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    known = sorted(p for p in {*_SPLITS, *_GPT2_PRE, "smollm"} if p)
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(known)})")


def _sentencepiece(tokens: list[str], scores: Sequence[float], arch: str) -> Tokenizer:
    """A SentencePiece BPE vocabulary (GGUF's "llama" tokenizer) as transformers builds it from a GGUF file: byte
    fallback, "▁" for spaces (Metaspace, prefixed to the text's start; Phi-3: a normalizer, prefixed always; Gemma:
    a normalizer, never prefixed), and the merges the file does not store, recovered from the scores
    (_sentencepiece_merges; Gemma's from the tokens' order, its scores do not follow its merges)."""
    gemma = arch in ("gemma", "gemma2", "gemma3")
    if gemma:  # Gemma's files spell a token of spaces alone with spaces, its tokenizer with "▁"
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    ids = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(
            vocab=ids, merges=_sentencepiece_merges(ids, dict(zip(tokens, scores))), fuse_unk=True, byte_fallback=True
        )
    )
    strip = [decoders.Strip(content=" ", left=1)]
    if arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif gemma:
        tok.normalizer, strip = normalizers.Replace(" ", "▁"), []
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _sentencepiece_merges(ids: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, as a merge ranked by the merged token's score, best first (ties:
    shorter left pieces first); a token's own splits in vocabulary order. transformers' generate_merges, so that
    both tokenize alike."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        merges += [(left, right, score) for left, right in sorted(pairs, key=lambda p: (ids[p[0]], ids[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


class TextTokenizer:
    """Encode/decode text and render the model's chat template.

    stop_ids: every token that ends generation (EOS, end-of-turn, generation_config's list).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_id: int | None,
        stop_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        special_tokens: dict[str, str],
    ):
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.stop_ids = frozenset(stop_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "TextTokenizer":
        """The tokenizer a GGUF file describes: byte-level BPE ("gpt2": vocabulary, merges, a pre-tokenizer by
        name) or SentencePiece BPE ("llama": Llama-2, Mistral, Phi-3, Gemma; vocabulary and scores)."""
        kind = f.field("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(f"{f.path}: unsupported GGUF tokenizer {kind!r} (BPE 'gpt2' or SentencePiece 'llama')")
        tokens: list[str] = f.field("tokenizer.ggml.tokens")
        types: list[int] = f.field("tokenizer.ggml.token_type")
        if kind == "llama":
            tok = _sentencepiece(tokens, f.field("tokenizer.ggml.scores"), f.field("general.architecture"))
            tok.add_special_tokens(
                [
                    AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types)
                    if ty in (_GGUF_UNKNOWN, _GGUF_CONTROL)
                ]
            )
            tok.add_tokens(
                [
                    AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types)
                    if ty == _GGUF_USER_DEFINED
                ]
            )
        else:
            merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges")]
            pre = f.field("tokenizer.ggml.pre")
            tok = Tokenizer(
                models.BPE(
                    vocab={t: i for i, t in enumerate(tokens)},
                    merges=merges,
                    fuse_unk=False,
                    byte_fallback=False,
                    ignore_merges=pre in _LLAMA3_PRE,
                )
            )
            tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
            tok.decoder = decoders.ByteLevel()
            specials = [t for t, ty in zip(tokens, types) if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        bos = f.field("tokenizer.ggml.bos_token_id")
        eos = int(f.field("tokenizer.ggml.eos_token_id"))
        stop = {eos} | {
            int(i) for key in ("eot_token_id", "eom_token_id") if (i := f.field(f"tokenizer.ggml.{key}")) is not None
        }
        stop |= {i for i, t in enumerate(tokens) if t in END_OF_TURN}  # as llama.cpp, where the file names none
        names = {"eos_token": tokens[eos]}
        if bos is not None:
            names["bos_token"] = tokens[int(bos)]
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        return cls(
            tok,
            bos_id=None if bos is None else int(bos),
            stop_ids=sorted(stop),
            add_bos=bool(f.field("tokenizer.ggml.add_bos_token", kind == "llama")),
            chat_template=f.field("tokenizer.chat_template"),
            special_tokens=names,
        )

    @classmethod
    def from_hf_dir(cls, root: str | pathlib.Path) -> "TextTokenizer":
        root = pathlib.Path(root)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{root}: no tokenizer.json (only fast-tokenizer directories are supported)")
        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg = _read_json(root / "tokenizer_config.json")

        def token_text(key: str) -> str | None:
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        names = {k: t for k in ("bos_token", "eos_token") if (t := token_text(k)) is not None}
        if "eos_token" not in names:
            raise ValueError(f"{root}: tokenizer_config.json names no eos_token")
        bos = names.get("bos_token")
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id", [])
        stop = {tok.token_to_id(names["eos_token"])} | set([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        # tokenizer.json's post-processor adds BOS where the model wants it; add_bos covers files without one.
        return cls(
            tok,
            bos_id=None if bos is None else tok.token_to_id(bos),
            stop_ids=sorted(stop),
            add_bos=bool(cfg.get("add_bos_token", False)),
            chat_template=template,
            special_tokens=names,
        )

    def save(self, root: pathlib.Path) -> None:
        """Write tokenizer.json + jaxserve_tokenizer.json, so a later start needs neither GGUF nor HF files."""
        self.tokenizer.save(str(root / "tokenizer.json"))
        meta = {
            "bos_id": self.bos_id,
            "stop_ids": sorted(self.stop_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens,
        }
        (root / "jaxserve_tokenizer.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, root: pathlib.Path) -> "TextTokenizer":
        meta = json.loads((root / "jaxserve_tokenizer.json").read_text())
        return cls(Tokenizer.from_file(str(root / "tokenizer.json")), **meta)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A rendered chat template carries its own BOS: pass add_special_tokens=False.
        Text that spells a control token (e.g. '<|im_end|>') becomes that token: a raw prompt is the model's
        input as the client wrote it. Safe to call from a worker thread while an event loop runs."""
        ids = _encode(self.tokenizer, text, add_special_tokens)
        if add_special_tokens and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template (which carries its own BOS); the arguments
        are apply_chat_template's. Control tokens come from the template only: text in a message that spells one
        is encoded as the plain text it is, so no content can forge a turn (e.g. end the user's turn and open a
        system one), nor can a tool's description or a call's arguments."""
        (messages, tools), originals = self._hide_special_text((list(messages), tools))
        text = self.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message)
        if not originals:
            return self.encode(text, add_special_tokens=False)
        marker = re.compile(re.escape(originals.nonce) + r"(\d+)\ue001")
        ids = []
        # the tokenizer encodes the text between control tokens piece by piece too: splitting here changes nothing
        for i, piece in enumerate(self._special_pattern.split(text)):  # odd pieces: the template's tokens
            if i % 2:
                ids.append(self.tokenizer.token_to_id(piece))
            elif piece:
                ids += _encode(self._as_text, marker.sub(lambda m: originals[int(m.group(1))], piece), False)
        return ids

    def _hide_special_text(self, tree: Any) -> tuple[Any, _Originals]:
        """`tree` (messages, tools: dicts, lists and strings) with each control token's text in any string
        replaced by a marker the template passes through, and what each marker stands for (empty if no string
        spells a control token)."""
        originals = _Originals(f"\ue000{secrets.token_hex(8)}:")
        pattern = self._special_pattern

        def hide(m: re.Match) -> str:
            originals.append(m.group(0))
            return f"{originals.nonce}{len(originals) - 1}\ue001"

        def walk(x: Any) -> Any:
            if isinstance(x, str):
                return pattern.sub(hide, x)
            if isinstance(x, dict):
                return {walk(k): walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(walk(v) for v in x)
            return x

        return (tree if pattern is None else walk(tree)), originals

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern | None:
        """The control tokens' texts, longest first (the tokenizer matches leftmost-longest), as one group."""
        texts = sorted(
            (t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    @functools.cached_property
    def _as_text(self) -> Tokenizer:
        """This tokenizer, reading control tokens' texts as plain text."""
        tok = Tokenizer.from_str(self.tokenizer.to_str())
        tok.encode_special_tokens = True
        return tok

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (byte-level vocabularies: bytes, an upper bound)."""
        return max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the template renders it (transformers' arguments: messages, tools,
        add_generation_prompt and the special tokens); a message may carry tool_calls and tool_call_id too.
        continue_final_message: the text ends inside the last message, after its content (a prefilled reply the
        model continues), as transformers cuts it."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt false")
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content'")
        extra = {} if tools is None else {"tools": list(tools)}
        try:
            text = _compile(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **extra, **self.special_tokens
            )
        except jinja2.TemplateError as e:  # e.g. the template's own raise_exception("roles must alternate")
            raise ValueError(f"chat template rejected the messages: {e}") from e
        return _cut_after_final(text, messages[-1]["content"]) if continue_final_message and messages else text


def _cut_after_final(text: str, final: str) -> str:
    """The rendered text up to the end of the last message's content (transformers' continue_final_message: the
    content's trailing spaces kept where the template kept them)."""
    if not final.strip() or final.strip() not in text:
        raise ValueError(
            "continue_final_message: the chat template does not render the last message's content as it is"
        )
    at = text.rindex(final.strip())
    keep = len(final.lstrip()) if text[at:].strip() == final.strip() else len(final.strip())
    return text[: at + keep]


class _Originals(list):
    """The texts markers stand for, in marker order; nonce: the markers' random prefix."""

    def __init__(self, nonce: str):
        super().__init__()
        self.nonce = nonce


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL while it works and encode does not: a long prompt tokenized in a worker
    # thread would otherwise stall the server's event loop for as long (1.8 s for 2 MB of text)
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    # The same sandboxed environment settings Hugging Face uses for chat templates.
    if source not in _TEMPLATES:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
