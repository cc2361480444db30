#!/usr/bin/env python3
"""Benchmark grammar libraries for structured output: xgrammar, llguidance, outlines-core.

Run from a separate venv that has the libraries (not jaxserve's):

    python3 -m venv grammar-venv     # anywhere: --tokenizer names the files it reads
    grammar-venv/bin/pip install xgrammar llguidance outlines-core tokenizers numpy absl-py
    grammar-venv/bin/python tools/studies/grammar_mask.py --tokenizer=PATH/tokenizer.json

For every library and grammar (json_object plus five JSON schemas of increasing size) it
  * compiles the grammar (compile ms) and builds a matcher per request (init ms),
  * walks a valid JSON document token by token (the document tokenized with the HF
    `tokenizers` tokenizer), timing (i) filling the int32 next-token bitmask and (ii) advancing
    the matcher by the token,
  * checks that every token is allowed by the mask at its step and that EOS is allowed at the end,
  * times 16 matchers in lockstep (batch API where the library has one, else a Python loop).

Everything is built from a `tokenizers.Tokenizer` (tokenizer.json), never transformers.

    python tools/studies/grammar_mask.py --jax_check   # (in a venv with jax) checks the JAX mask apply
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags
from typing import Any

import numpy as np

# --------------------------------------------------------------------------------------------
# Grammars and valid instances
# --------------------------------------------------------------------------------------------


def _obj(props: dict, required: list | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


S_STR, S_INT, S_NUM, S_BOOL = ({"type": t} for t in ("string", "integer", "number", "boolean"))

CASES: list[tuple[str, dict | None, Any]] = [
    (
        "json_object",
        None,  # any JSON object
        {
            "query": "best hiking trails near Lake Tahoe",
            "results": [
                {"title": "Rubicon Trail", "miles": 16.2, "dog_friendly": True},
                {"title": "Mount Tallac", "miles": 9.5, "dog_friendly": False},
            ],
            "total": 2,
            "cached": False,
            "error": None,
        },
    ),
    (
        "s1_flat",
        _obj({"name": S_STR, "age": S_INT, "active": S_BOOL}),
        {"name": "Ada Lovelace", "age": 36, "active": True},
    ),
    (
        "s2_nested",
        _obj(
            {
                "user": _obj(
                    {
                        "id": S_INT,
                        "name": S_STR,
                        "address": _obj({"street": S_STR, "city": S_STR, "country": S_STR}),
                    }
                ),
                "meta": _obj({"source": S_STR, "confidence": S_NUM}),
            }
        ),
        {
            "user": {
                "id": 48213,
                "name": "Grace Hopper",
                "address": {"street": "12 Navy Yard Rd", "city": "Arlington", "country": "US"},
            },
            "meta": {"source": "crm-export", "confidence": 0.97},
        },
    ),
    (
        "s3_array_enum",
        _obj(
            {
                "order_id": S_STR,
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                "items": {
                    "type": "array",
                    "items": _obj(
                        {
                            "sku": S_STR,
                            "status": {
                                "type": "string",
                                "enum": ["in_stock", "backorder", "discontinued"],
                            },
                            "qty": S_INT,
                            "price": S_NUM,
                        }
                    ),
                },
            }
        ),
        {
            "order_id": "ORD-2024-00917",
            "currency": "EUR",
            "items": [
                {"sku": "KB-104", "status": "in_stock", "qty": 2, "price": 49.9},
                {"sku": "MS-221", "status": "backorder", "qty": 1, "price": 19.5},
                {"sku": "HD-900", "status": "discontinued", "qty": 5, "price": 3.25},
                {"sku": "CB-USB", "status": "in_stock", "qty": 10, "price": 7.0},
            ],
        },
    ),
    (
        "s4_constraints",
        _obj(
            {
                "ticket": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "title": {"type": "string", "minLength": 5, "maxLength": 60},
                "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                "score": {"type": "number", "minimum": 0, "maximum": 100},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 1,
                    "maxItems": 4,
                },
                "reporter": {"type": "string", "format": "email"},
            }
        ),
        {
            "ticket": "OPS-4821",
            "title": "Disk usage alert on build runner",
            "priority": 2,
            "score": 73.5,
            "tags": ["infra", "disk", "ci"],
            "reporter": "oncall@example.com",
        },
    ),
    (
        "s5_large",
        _obj(
            {
                "id": {"type": "string", "format": "uuid"},
                "title": S_STR,
                "company": _obj({"name": S_STR, "website": {"type": "string", "format": "uri"}}),
                "location": _obj({"city": S_STR, "country": S_STR, "remote": S_BOOL}),
                "employment_type": {
                    "type": "string",
                    "enum": ["full_time", "part_time", "contract", "internship"],
                },
                "level": {"type": "string", "enum": ["junior", "mid", "senior", "staff"]},
                "department": S_STR,
                "salary": _obj(
                    {
                        "min": S_INT,
                        "max": S_INT,
                        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                    }
                ),
                "posted_at": {"type": "string", "format": "date-time"},
                "experience_years": {"type": "integer", "minimum": 0, "maximum": 50},
                "skills": {"type": "array", "items": S_STR},
                "benefits": {"type": "array", "items": S_STR},
                "description": S_STR,
                "contact_email": {"type": "string", "format": "email"},
                "is_active": S_BOOL,
                "rating": {"type": ["number", "null"]},
            },
            required=[
                "id",
                "title",
                "company",
                "location",
                "employment_type",
                "level",
                "department",
                "salary",
                "posted_at",
                "experience_years",
                "skills",
                "description",
                "contact_email",
                "is_active",
            ],
        ),
        {
            "id": "3f2b8c1e-9a4d-4e7b-b2c6-5d8e1f0a7c93",
            "title": "Senior Machine Learning Engineer",
            "company": {"name": "Northwind Analytics", "website": "https://northwind.example.com"},
            "location": {"city": "Berlin", "country": "Germany", "remote": True},
            "employment_type": "full_time",
            "level": "senior",
            "department": "Applied Research",
            "salary": {"min": 85000, "max": 120000, "currency": "EUR"},
            "posted_at": "2025-03-14T09:30:00Z",
            "experience_years": 5,
            "skills": ["Python", "JAX", "distributed training", "Kubernetes"],
            "benefits": ["30 days vacation", "learning budget"],
            "description": (
                "You will design and ship large-scale training and inference pipelines, work "
                "closely with product teams, and mentor engineers on model evaluation."
            ),
            "contact_email": "jobs@northwind.example.com",
            "is_active": True,
            "rating": 4.6,
        },
    ),
]


# --------------------------------------------------------------------------------------------
# Adapters: each builds from a tokenizers.Tokenizer
# --------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


class XGrammar:
    name = "xgrammar"
    has_batch_api = True

    def __init__(self, tok, vocab_size: int, eos: int, threads: int):
        import xgrammar as xgr
        from xgrammar.base import _core

        self.xgr = xgr
        vocab = tok.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for s, i in vocab.items():
            if i < vocab_size:
                encoded[i] = s
        # Same detection from_huggingface does, but from the tokenizers JSON (no transformers).
        meta = json.loads(_core.TokenizerInfo._detect_metadata_from_hf(tok.to_str()))
        self.info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType(meta["vocab_type"]),
            vocab_size=vocab_size,
            stop_token_ids=[eos],
            add_prefix_space=meta["add_prefix_space"],
        )
        self.meta = meta
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema):
        # cache off so the timing is a cold compile; a server keeps cache_enabled=True
        comp = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if schema is None:
            return comp.compile_builtin_json_grammar()
        return comp.compile_json_schema(json.dumps(schema))

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask, row):
        m.fill_next_token_bitmask(mask, row)

    def accept(self, m, t):
        return m.accept_token(t)

    def finish(self, m, eos):
        return m.accept_token(eos) and m.is_terminated()

    def batch_fill(self, ms, mask):
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def batch_accept(self, ms, toks):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)


class LLGuidance:
    name = "llguidance"
    has_batch_api = True

    def __init__(self, tok, vocab_size: int, eos: int, threads: int):
        import llguidance
        import llguidance.numpy as lnp

        self.ll, self.lnp = llguidance, lnp
        # LLTokenizer takes the tokenizer.json text directly (what llguidance.hf does too)
        self.lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema):
        # No separate compiled artifact: schema -> grammar text -> LLMatcher (lexer built
        # lazily). The fresh matcher is kept as a per-schema template; requests deep_copy it.
        g = self.ll.LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema)
        m = self.ll.LLMatcher(self.lltok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask, row):
        self.lnp.fill_next_token_bitmask(m, mask, row)

    def accept(self, m, t):
        return m.consume_token(t)

    def finish(self, m, eos):
        return m.is_accepting() and m.consume_token(eos) and m.is_stopped()

    def batch_fill(self, ms, mask):
        self.lnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def batch_accept(self, ms, toks):
        return self.executor.consume_token_par(list(zip(ms, toks)))


class OutlinesCore:
    name = "outlines-core"
    has_batch_api = False

    def __init__(self, tok, vocab_size: int, eos: int, threads: int):
        import outlines_core as oc

        self.oc = oc
        u2b = {v: k for k, v in _bytes_to_unicode().items()}
        special = set(tok.get_added_tokens_decoder())
        table: dict[bytes, list[int]] = {}
        for s, i in tok.get_vocab(with_added_tokens=True).items():
            if i in special or i == eos:
                continue  # special tokens must not match text; EOS is passed separately
            b = bytes(u2b[c] for c in s)  # byte-level BPE (GPT-2 alphabet) -> raw bytes
            table.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(eos, table)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(
            json.dumps({"type": "object"} if schema is None else schema)
        )
        return self.oc.Index(regex, self.vocab)

    def new_matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, mask, row):
        r = mask[row]
        m.write_mask_into(r.ctypes.data, r.size, 4)

    def accept(self, m, t):
        m.advance(t, return_tokens=False)
        return True

    def finish(self, m, eos):
        return m.is_finished()

    def batch_fill(self, ms, mask):
        for i, m in enumerate(ms):
            r = mask[i]
            m.write_mask_into(r.ctypes.data, r.size, 4)

    def batch_accept(self, ms, toks):
        return [m.advance(t, return_tokens=False) or True for m, t in zip(ms, toks)]


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------


def bit(mask_row: np.ndarray, t: int) -> bool:
    return bool((int(mask_row.view(np.uint32)[t >> 5]) >> (t & 31)) & 1)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench_case(ad, schema, doc, tok, vocab_size, eos, reps, batch):
    words = (vocab_size + 31) // 32
    text = json.dumps(doc)
    ids = tok.encode(text, add_special_tokens=False).ids
    out: dict[str, Any] = {"tokens": len(ids)}

    t0 = time.perf_counter()
    compiled = ad.compile(schema)
    out["compile_ms"] = (time.perf_counter() - t0) * 1e3

    inits, fills, accepts = [], [], []
    ok, bad = True, ""
    mask = np.zeros((1, words), dtype=np.int32)
    allowed_counts = []
    for rep in range(reps):
        t0 = time.perf_counter()
        m = ad.new_matcher(compiled)
        inits.append((time.perf_counter() - t0) * 1e3)
        for step, t in enumerate(ids):
            mask[0] = 0
            t0 = time.perf_counter_ns()
            ad.fill(m, mask, 0)
            t1 = time.perf_counter_ns()
            if rep == 0:
                allowed_counts.append(int(np.unpackbits(mask.view(np.uint8)).sum()))
            if not bit(mask[0], t) and ok:
                ok, bad = False, f"token {t} {tok.decode([t])!r} masked at step {step}"
            t2 = time.perf_counter_ns()
            acc = ad.accept(m, t)
            t3 = time.perf_counter_ns()
            if not acc and ok:
                ok, bad = False, f"token {t} rejected at step {step}"
            fills.append((t1 - t0) / 1e3)
            accepts.append((t3 - t2) / 1e3)
        mask[0] = 0
        ad.fill(m, mask, 0)
        if not bit(mask[0], eos) and ok:
            ok, bad = False, "EOS not allowed at end"
        if not ad.finish(m, eos) and ok:
            ok, bad = False, "matcher did not accept termination"
    out.update(
        init_ms=statistics.median(inits),
        fill_p50=statistics.median(fills),
        fill_p99=pct(fills, 0.99),
        fill_max=max(fills),
        acc_p50=statistics.median(accepts),
        acc_p99=pct(accepts, 0.99),
        ok=ok,
        why=bad,
        mean_allowed=statistics.mean(allowed_counts),
    )

    # batch: `batch` matchers in lockstep over the same document, one mask row each
    bmask = np.zeros((batch, words), dtype=np.int32)
    bfill, bacc = [], []
    for rep in range(max(1, reps // 2)):
        ms = [ad.new_matcher(compiled) for _ in range(batch)]
        for t in ids:
            t0 = time.perf_counter_ns()
            ad.batch_fill(ms, bmask)
            t1 = time.perf_counter_ns()
            if not all(bit(bmask[i], t) for i in range(batch)):
                out["ok"], out["why"] = False, "batch mask disagrees"
            t2 = time.perf_counter_ns()
            ad.batch_accept(ms, [t] * batch)
            t3 = time.perf_counter_ns()
            bfill.append((t1 - t0) / 1e3)
            bacc.append((t3 - t2) / 1e3)
    out.update(bfill_p50=statistics.median(bfill), bfill_p99=pct(bfill, 0.99), bacc_p50=statistics.median(bacc))
    return out


def jax_check(vocab_size: int = 49152, batch: int = 16) -> None:
    """Check (and time) applying an int32 [B, ceil(V/32)] bitmask to [B, V] logits in JAX."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def apply_bitmask(logits, bitmask):
        v = logits.shape[-1]
        idx = jnp.arange(v)
        words = bitmask[:, idx >> 5]  # [B, V] gather of the packed word
        allowed = ((words >> (idx & 31)) & 1).astype(bool)  # arithmetic shift is fine: &1
        return jnp.where(allowed, logits, -jnp.inf)

    rng = np.random.default_rng(0)
    words = (vocab_size + 31) // 32
    bm = rng.integers(-(2**31), 2**31 - 1, size=(batch, words), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((batch, vocab_size)).astype(np.float32)
    ref = np.unpackbits(bm.view(np.uint8), bitorder="little").reshape(batch, -1)[:, :vocab_size]
    got = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(bm)))
    assert np.array_equal(np.isfinite(got), ref.astype(bool)), "bit order mismatch"
    x, b = jnp.asarray(logits), jnp.asarray(bm)
    apply_bitmask(x, b).block_until_ready()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        apply_bitmask(x, b).block_until_ready()
    print(
        f"jax apply_bitmask OK on {jax.devices()[0].platform}: "
        f"{(time.perf_counter() - t0) / n * 1e6:.0f} us for [{batch},{vocab_size}]"
    )


flags.DEFINE_multi_string("tokenizer", [], "A tokenizer.json path (repeatable).")
flags.DEFINE_multi_integer(
    "eos",
    [],
    "EOS id per tokenizer (default: stop_ids[0] of jaxserve_tokenizer.json beside it, else the tokenizer's "
    "</s>-like token).",
)
flags.DEFINE_list("libs", ["xgrammar", "llguidance", "outlines-core"], "The libraries to compare.")
flags.DEFINE_integer("reps", 6, "Walks of each document.")
flags.DEFINE_integer("batch", 16, "Matchers in lockstep.")
flags.DEFINE_integer("threads", os.cpu_count() or 1, "Threads a library may use.")
flags.DEFINE_string("out", "", "Write the markdown table here too.")
flags.DEFINE_bool("jax_check", False, "Check the JAX mask apply instead (in a venv with jax).")


def main(argv: list[str]) -> None:
    del argv
    a = flags.FLAGS
    if a.jax_check:
        jax_check(batch=a.batch)
        return

    import tokenizers

    lines = [
        "| tokenizer (V) | lib | grammar | toks | compile ms | init ms | mask p50/p99 us "
        "| accept p50/p99 us | B16 mask p50/p99 us | B16 accept p50 us | avg allowed | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ti, path in enumerate(a.tokenizer):
        tok = tokenizers.Tokenizer.from_file(path)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if ti < len(a.eos):
            eos = a.eos[ti]
        else:
            side = os.path.join(os.path.dirname(path), "jaxserve_tokenizer.json")
            eos = json.load(open(side))["stop_ids"][0] if os.path.exists(side) else 0
        label = f"{os.path.basename(os.path.dirname(path)).split('.')[0]} ({vocab_size})"
        for lib in a.libs:
            mod = {"xgrammar": "xgrammar", "llguidance": "llguidance.numpy", "outlines-core": "outlines_core"}[lib]
            t0 = time.perf_counter()
            try:
                __import__(mod)
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {label} | {lib} | import failed: {e} |")
                continue
            import_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            try:
                ad = ADAPTERS[lib](tok, vocab_size, eos, a.threads)
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {label} | {lib} | setup failed: {e} |")
                continue
            setup_ms = (time.perf_counter() - t0) * 1e3
            print(f"{lib}: import {import_ms:.0f} ms, tokenizer setup {setup_ms:.0f} ms", file=sys.stderr)
            lines.append(
                f"| {label} | {lib} | import / tokenizer setup | | {import_ms:.0f} / {setup_ms:.0f} | | | | | | | |"
            )
            for name, schema, doc in CASES:
                try:
                    r = bench_case(ad, schema, doc, tok, vocab_size, eos, a.reps, a.batch)
                except Exception as e:  # noqa: BLE001
                    msg = str(e).replace("\n", " ").replace("|", "/")[:90]
                    lines.append(f"| {label} | {lib} | {name} | | FAILED: {msg} | | | | | | | no |")
                    print(f"{lib} {name}: FAILED {msg}", file=sys.stderr)
                    continue
                okc = "yes" if r["ok"] else f"NO: {r['why']}"
                lines.append(
                    f"| {label} | {lib} | {name} | {r['tokens']} | {r['compile_ms']:.1f} "
                    f"| {r['init_ms']:.3f} | {r['fill_p50']:.1f} / {r['fill_p99']:.0f} "
                    f"| {r['acc_p50']:.1f} / {r['acc_p99']:.0f} "
                    f"| {r['bfill_p50']:.0f} / {r['bfill_p99']:.0f} | {r['bacc_p50']:.0f} "
                    f"| {r['mean_allowed']:.0f} | {okc} |"
                )
                print(lines[-1], file=sys.stderr)
    table = "\n".join(lines)
    print(table)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    app.run(main)
