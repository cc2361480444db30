"""Write Hugging Face transformers reference outputs for SmolLM2-135M-Instruct (the same GGUF file jaxserve loads).

The tests compare jaxserve against these fixtures, so torch and transformers are needed only to re-run this:

    .venv/bin/pip install -e '.[reference]'
    .venv/bin/python tools/make_reference_fixtures.py            # writes tests/fixtures/smollm2_reference.*

Recorded, in float32: token ids from the GGUF tokenizer for a set of texts, the rendered chat template, full-vocab
prefill logits at a few positions of several prompts, and 32 greedy tokens with and without the chat template.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxserve.models import registry  # noqa: E402  (registry is pure Python: no jax import)

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"

LONG_TEXT = " ".join(
    f"Paragraph {i}: the river carried {i * 7 % 13} boats past the old mill, where the miller counted "
    f"{i * 3 + 1} sacks of grain and wrote the number 0.{i:03d} in a ledger that smelled of dust."
    for i in range(24)
)

TOKENIZER_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\tand tabs\nnew lines\n\n",
    "Unicode: café, naïve, 東京, emoji 🙂 and ümlauts.",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>",
]

PLAIN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    LONG_TEXT,
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Give me three colors."},
    ],
]

GREEDY_TOKENS = 32

# A Llama-3.1-style rope scaling config; its inverse frequencies check jaxserve's rope-scaling code.
LLAMA3_ROPE = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def llama3_inv_freq() -> list[float]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig(**LLAMA3_ROPE)).inv_freq.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=registry.DEFAULT_MODEL)
    ap.add_argument("--out", default=str(FIXTURES / "smollm2_reference"))
    args = ap.parse_args()

    gguf_path = registry.resolve(args.model)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()

    meta: dict = {"model": args.model, "tokenizer": [], "prefill": [], "greedy": []}
    arrays: dict[str, np.ndarray] = {}

    for text in TOKENIZER_TEXTS:
        meta["tokenizer"].append({"text": text, "ids": tok(text, add_special_tokens=False)["input_ids"]})

    chat_texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHATS]
    meta["chat_template"] = [{"messages": c, "text": t} for c, t in zip(CHATS, chat_texts)]

    prompts = [(p, False) for p in PLAIN_PROMPTS] + [(t, True) for t in chat_texts]
    with torch.no_grad():
        for i, (text, is_chat) in enumerate(prompts):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0].numpy()
            positions = sorted({0, len(ids) // 2, len(ids) - 1})
            arrays[f"logits_{i}"] = logits[positions].astype(np.float32)
            meta["prefill"].append({"ids": ids, "positions": positions, "chat": is_chat})
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )[0, len(ids) :].tolist()
            meta["greedy"].append({"ids": ids, "chat": is_chat, "tokens": out, "text": tok.decode(out)})
            print(f"prompt {i}: {len(ids)} tokens -> {tok.decode(out)!r}")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out.with_suffix(".npz"), **arrays)
    meta["llama3_rope"] = {"config": LLAMA3_ROPE, "inv_freq": llama3_inv_freq()}
    meta["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    print(f"wrote {out}.json and {out}.npz")


if __name__ == "__main__":
    main()
