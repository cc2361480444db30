"""jaxserve vs Hugging Face transformers on the same machine, same model file, same dtype, one run; or, with
--gpu, jaxserve's own serving throughput on a GPU for each of --gpu_models, in bfloat16.

    .venv/bin/pip install -e '.[reference]'
    .venv/bin/python tools/bench/generate.py [--decode_tokens=64] [--repeats=3] [--out=bench.json]
    .venv/bin/python tools/bench/generate.py --gpu [--gpu_models=random:llama3-8b,smollm2-135m-instruct]
        [--num_scheduler_steps=8]

--gpu needs no download and no transformers: `random:llama3-8b` is Llama-3.1-8B's shapes with random bf16 weights
drawn on the device (models/random_weights.py); absolute tokens/s are reported, as only a GPU gives them. With
--extras or --structured the same engine is measured again with penalties and logprobs, or a JSON schema, on every
request; the ratio to the plain figures is what a CPU can report too:

    .venv/bin/python tools/bench/generate.py --gpu --dtype=float32 --gpu_models=smollm2-135m-instruct --structured

Both sides are timed the same way, through their generate APIs, after a warm-up (jaxserve compiles its step
functions then): decode tokens/s = batch * (N - 1) / (t(N tokens) - t(1 token)), so prefill time cancels out;
prefill tokens/s = prompt tokens / t(1 token). The two sides' runs alternate; medians over --repeats. Prints a
table and the ratios against issue 32's bars: decode batch 1 >= 2.5x, the batch-16 aggregate >= 2x transformers'
batch 16, prefill >= 1.2x.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

import jaxserve
from jaxserve import SamplingParams, xla_flags
from jaxserve.models import registry

FLAGS = flags.FLAGS
flags.DEFINE_string("model", registry.DEFAULT_MODEL, "Registered model name or path (GGUF).")
flags.DEFINE_integer("decode_tokens", 64, "Tokens generated per request in the decode measurements.")
flags.DEFINE_integer("short_prompt", 32, "Prompt tokens for the decode measurements.")
flags.DEFINE_integer("long_prompt", 1024, "Prompt tokens for the prefill measurement.")
flags.DEFINE_integer("batch", 16, "Batch size of the aggregate decode measurement.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions; the median is reported.")
flags.DEFINE_string("out", None, "Optional JSON file for the results.")
flags.DEFINE_bool("gpu", False, "jaxserve alone, in --dtype, for each of --gpu_models (absolute figures).")
flags.DEFINE_string("dtype", "bfloat16", "--gpu: the serving dtype (float32 for a CPU's figures).")
flags.DEFINE_string(
    "tokenizer",
    None,
    "--gpu: a tokenizer folder used instead of the models' (a random: model's "
    "word tokenizer cannot drive --structured's grammar).",
)
flags.DEFINE_list("gpu_models", ["random:llama3-8b", "smollm2-135m-instruct"], "Models for --gpu.")
flags.DEFINE_integer(
    "num_scheduler_steps", None, "jaxserve's multi-step decode: most decode steps in one burst (default: the engine's)."
)
flags.DEFINE_bool(
    "extras",
    False,
    "--gpu: each model also with penalties and logprobs on every request (the extra "
    "sampler), measured beside the plain one.",
)
flags.DEFINE_bool(
    "structured",
    False,
    "--gpu: each model also with a JSON schema on every request (structured "
    "output: a mask from the host each step), measured beside the plain one.",
)

# what the extra sampler does for every row: history penalties, logit_bias and the top-5 logprobs
EXTRAS = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3, logit_bias={0: -1.0}, logprobs=5)
# a JSON schema no request completes in the tokens it is given: every row decodes all of them under a mask
STRUCTURED = dict(
    structured_output={
        "json": {"type": "array", "items": {"type": "integer"}, "minItems": 10000},
        "disable_any_whitespace": True,
    }
)


def prompts(n: int, length: int, seed: int, vocab: int = 40000) -> list[list[int]]:
    # Random ordinary tokens (ids above the special tokens), so both sides see identical inputs.
    rng = np.random.default_rng(seed)
    return [rng.integers(min(100, vocab // 2), vocab, size=length).tolist() for _ in range(n)]


class JaxServeSide:
    name = "jaxserve"

    def __init__(
        self,
        model: str,
        batch: int,
        long_prompt: int,
        dtype: str = "float32",
        num_scheduler_steps: int | None = None,
        llm: jaxserve.LLM | None = None,
        options: dict | None = None,
        tokenizer: str | None = None,
        **settings,
    ):
        # no prefix caching: every repetition sends the same prompts, and transformers computes them each time
        self.llm = llm or jaxserve.LLM(
            model,
            dtype=dtype,
            max_model_len=max(2048, 2 * long_prompt),
            max_num_seqs=batch,
            enable_prefix_caching=False,
            num_scheduler_steps=num_scheduler_steps,
            tokenizer=tokenizer,
            **settings,
        )
        self.options = options or {}

    def generate(self, batch: list[list[int]], n: int) -> list[list[int]]:
        outs = self.llm.generate(batch, SamplingParams(max_tokens=n, ignore_eos=True, **self.options))
        assert all(len(o.token_ids) == n for o in outs)
        return [o.token_ids for o in outs]


class TransformersSide:
    name = "transformers"

    def __init__(self, model: str):
        import torch
        from transformers import AutoModelForCausalLM

        path = registry.resolve(model)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()

    def generate(self, batch: list[list[int]], n: int) -> None:
        import torch

        ids = torch.tensor(batch)
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + n


def measure(
    sides: list, batch: int, short: int, long: int, n: int, repeats: int, vocab: int = 40000
) -> dict[str, dict[str, float]]:
    """Every metric for every side; the sides' repetitions interleave so background load hits both alike."""
    decode = {
        "decode_tok_s_batch1": prompts(1, short, 0, vocab),
        f"decode_tok_s_batch{batch}": prompts(batch, short, 1, vocab),
    }
    prefill_key, big = f"prefill_tok_s_{long}", prompts(1, long, 2, vocab)
    runs = [(key, p, tokens) for key, p in decode.items() for tokens in (1, n)] + [(prefill_key, big, 1)]
    times: dict[tuple[str, str, int], list[float]] = {}
    for side in sides:  # warm-up: jaxserve compiles every shape used below
        for key, p, tokens in runs:
            side.generate(p, max(tokens, 2))
    with tqdm(total=len(sides) * repeats * len(runs), desc="bench") as bar:
        for _ in range(repeats):
            for key, p, tokens in runs:
                for side in sides:
                    start = time.perf_counter()
                    side.generate(p, tokens)
                    times.setdefault((side.name, key, tokens), []).append(time.perf_counter() - start)
                    bar.update()
    res: dict[str, dict[str, float]] = {}
    for side in sides:
        t = {k[1:]: statistics.median(v) for k, v in times.items() if k[0] == side.name}
        res[side.name] = {key: len(p) * (n - 1) / (t[key, n] - t[key, 1]) for key, p in decode.items()}
        res[side.name][prefill_key] = long / t[prefill_key, 1]
    return res


def gpu_table(f) -> dict[str, dict[str, float]]:
    """jaxserve's figures for each model, in --dtype, on this machine's first device."""
    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "num_scheduler_steps": f.num_scheduler_steps,
        "dtype": f.dtype,
    }
    for model in f.gpu_models:
        side = JaxServeSide(
            model,
            f.batch,
            f.long_prompt,
            dtype=f.dtype,
            num_scheduler_steps=f.num_scheduler_steps,
            tokenizer=f.tokenizer,
        )
        side.name = model
        sides = [side]
        # the same engine, every request with penalties and logprobs, or with a grammar
        for on, name, options in ((f.extras, "extras", EXTRAS), (f.structured, "json_schema", STRUCTURED)):
            if on:
                sides.append(JaxServeSide(model, f.batch, f.long_prompt, llm=side.llm, options=options))
                sides[-1].name = f"{model} {name}"
        results.update(
            measure(
                sides,
                f.batch,
                f.short_prompt,
                f.long_prompt,
                f.decode_tokens,
                f.repeats,
                vocab=min(40000, side.llm.config.vocab_size),
            )
        )
        del side, sides
        if f.out:  # a crash in a later model keeps what was measured
            with open(f.out, "w") as fh:
                json.dump(results, fh, indent=1)
    print(f"{results['device']}, jax {results['jax']}, {f.dtype}")
    for model in (m for m in results if isinstance(results[m], dict)):
        for key, value in results[model].items():
            print(f"{model:<34}{key:<28}{value:>12.1f} tok/s")
    return results


def main(argv: list[str]) -> None:
    del argv
    xla_flags.for_gpu(os.environ)  # the launcher's flags, before JAX starts its backend
    f = FLAGS
    if f.gpu:
        gpu_table(f)
        return
    import torch

    print(f"torch {torch.__version__} threads {torch.get_num_threads()}; jax {jax.__version__} {jax.devices()}")
    sides = [
        TransformersSide(f.model),
        JaxServeSide(f.model, f.batch, f.long_prompt, num_scheduler_steps=f.num_scheduler_steps),
    ]
    results = measure(sides, f.batch, f.short_prompt, f.long_prompt, f.decode_tokens, f.repeats)
    hf_r, js_r = results["transformers"], results["jaxserve"]
    b1 = js_r["decode_tok_s_batch1"] / hf_r["decode_tok_s_batch1"]
    agg = js_r[f"decode_tok_s_batch{f.batch}"] / hf_r[f"decode_tok_s_batch{f.batch}"]
    pre = js_r[f"prefill_tok_s_{f.long_prompt}"] / hf_r[f"prefill_tok_s_{f.long_prompt}"]
    results["ratios"] = {"decode_batch1": b1, f"decode_batch{f.batch}": agg, "prefill": pre}
    print(f"{'metric':<28}{'transformers':>14}{'jaxserve':>12}")
    for key in js_r:
        print(f"{key:<28}{hf_r[key]:>14.1f}{js_r[key]:>12.1f}")
    print(f"ratio decode batch 1 (jaxserve / transformers):       {b1:.2f}x  (target >= 2.5x)")
    print(f"ratio decode batch {f.batch} aggregate (jaxserve / transformers): {agg:.2f}x  (target >= 2x)")
    print(f"ratio prefill {f.long_prompt} tokens (jaxserve / transformers):  {pre:.2f}x  (target >= 1.2x)")
    if f.out:
        with open(f.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
