"""Weights kept quantized (--quantization) against the unquantized model, in one run on this machine: the weights'
resident bytes, greedy agreement over 20 prompts of real text, and decode / prefill tokens/s measured side by side
(tools/bench/generate.py's timing: the methods' runs interleave, medians over --repeats).

    .venv/bin/python tools/bench/quantization.py [--methods=int8,int4,gguf] [--repeats=3] [--out=quant.json]
    .venv/bin/python tools/bench/quantization.py --model=random:llama3-8b --dtype=bfloat16 --methods=int8,int4,fp8

Agreement: of the 20 prompts, how many give exactly the unquantized model's --max_tokens greedy tokens, and the
mean share of each output that matches before the first differing token. A random: model has no real text to
agree on; its agreement is over random token prompts.
"""

from __future__ import annotations

import json
import os

import jax
from absl import app, flags
from tqdm import tqdm

from jaxserve import SamplingParams, xla_flags
from jaxserve.models import quantize
from generate import JaxServeSide, measure, prompts  # and its flags: --model, --dtype, --batch, ...

FLAGS = flags.FLAGS
flags.DEFINE_list("methods", ["int8", "int4", "gguf"], "Quantization methods beside the unquantized model.")
flags.DEFINE_integer("max_tokens", 32, "Greedy tokens per prompt for the agreement.")
FLAGS.set_default("dtype", "float32")  # the unquantized model's dtype, which the quantized ones compute in
FLAGS.set_default("long_prompt", 512)

# 20 prompts of real text: instructions, facts, code, lists, so greedy decoding is not degenerate
TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Explain photosynthesis in one sentence.",
    "The three primary colors are",
    "Translate 'good morning' into Spanish:",
    "Once upon a time, in a small village,",
    "What is the boiling point of water?",
    "List three fruits that are red:",
    "import numpy as np\n# compute the mean of an array",
    "The largest planet in the solar system is",
    "Give me a tip for learning to cook.",
    "Summer is my favourite season because",
    "Q: What is 12 times 12?\nA:",
    "The Eiffel Tower was built in",
    "Describe a cat in five words.",
    "SELECT name FROM users WHERE",
    "The opposite of hot is",
    "My favourite book is",
]


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict[str, float]:
    """Prompts whose tokens all equal the reference's, and the mean share matching before the first difference."""

    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    shares = [prefix(r, o) / max(len(r), 1) for r, o in zip(reference, outputs)]
    return {
        "identical": sum(r == o for r, o in zip(reference, outputs)),
        "prompts": len(reference),
        "matching_prefix": sum(shares) / len(shares),
    }


def main(argv: list[str]) -> None:
    del argv
    xla_flags.for_gpu(os.environ)
    f = FLAGS
    sides = []
    for method in tqdm([None, *f.methods], desc="load"):
        # each engine's KV pool sized for the measurements: several engines share the device
        side = JaxServeSide(
            f.model,
            f.batch,
            f.long_prompt,
            dtype=f.dtype,
            quantization=method,
            kv_cache_tokens=f.batch * max(2048, 2 * f.long_prompt),
        )
        side.name = method or f.dtype
        sides.append(side)
    tokenizer = sides[0].llm.tokenizer
    vocab = min(40000, sides[0].llm.config.vocab_size)
    texts = [tokenizer.encode(t) for t in TEXTS] if not f.model.startswith("random:") else prompts(20, 16, 3, vocab)
    greedy = SamplingParams(max_tokens=f.max_tokens)
    outputs = {s.name: [c.token_ids for c in s.llm.generate(texts, greedy)] for s in tqdm(sides, desc="greedy")}
    speed = measure(sides, f.batch, 32, f.long_prompt, f.decode_tokens, f.repeats, vocab=vocab)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": f.model}
    full = quantize.nbytes(sides[0].llm.builder.params)
    for side in sides:
        weights = quantize.nbytes(side.llm.builder.params)
        results[side.name] = {
            "weights_mib": weights / 2**20,
            "of_unquantized": weights / full,
            **agreement(outputs[sides[0].name], outputs[side.name]),
            **speed[side.name],
        }
    print(f"{results['device']}, jax {results['jax']}, {f.model}")
    keys = list(results[sides[0].name])
    print(f"{'':<10}" + "".join(f"{k:>24}" for k in keys))
    for side in sides:
        print(f"{side.name:<10}" + "".join(f"{results[side.name][k]:>24.3f}" for k in keys))
    if f.out:
        with open(f.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
