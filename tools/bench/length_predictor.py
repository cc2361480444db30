"""Decode-length prediction on a held-out trace: the prompt classifier (sched/length_classifier.py, over the served
model's own prompt features, cluster/prompt_features.py) beside the running mean of served lengths
(ObservedLengths, the live default) and a per-prompt-length-band Bayes classifier fitted on the training split
(BucketPredictor, what the TetriInfer claim's simulation uses).

    .venv/bin/python tools/bench/length_predictor.py [--prompts=480] [--out=bench_out/length_predictor]

The trace: instructions of several kinds (one-word answers, definitions, lists, poems, summaries of long passages,
essays, code with explanations), with topics drawn at random, each answered greedily by the served model (its chat
template, up to --max_tokens). It is written to --out/trace.jsonl with the model and settings it came from, and
rebuilt when they differ or the file does not parse. The first --train share of the trace (in its shuffled order)
teaches each predictor as a server would (one finished request at a time); the rest is held out. Accuracy: the share
of held-out requests whose decode length falls in the predicted bucket (TetriInfer's measure; --granularity tokens
per bucket). Writes results.json and prints a table; docs/BENCHMARKS.md "Decode-length prediction" has today's.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("prompts", 480, "Prompts in the trace.")
flags.DEFINE_integer("max_tokens", 800, "Most tokens an answer may have.")
flags.DEFINE_integer("granularity", 200, "Tokens per length bucket (TetriInfer: 200).")
flags.DEFINE_float("train", 0.7, "Share of the trace the predictors learn from; the rest is held out.")
flags.DEFINE_integer("seed", 0, "The trace's random draws.")
flags.DEFINE_string("model", None, "The served model (default: jaxserve's default).")
flags.DEFINE_string("out", "bench_out/length_predictor", "Folder for trace.jsonl and results.json.")

TOPICS = (
    "volcanoes",
    "the Roman empire",
    "photosynthesis",
    "black holes",
    "the French revolution",
    "honey bees",
    "the internet",
    "climate change",
    "chess",
    "the human heart",
    "coffee",
    "the Moon landing",
    "glaciers",
    "electric cars",
    "the printing press",
    "jazz",
    "the Amazon rainforest",
    "vaccines",
    "bridges",
    "the stock market",
    "dinosaurs",
    "the Olympic games",
    "rainbows",
    "submarines",
    "bread baking",
    "tigers",
    "democracy",
    "earthquakes",
    "the violin",
    "solar panels",
    "ancient Egypt",
    "sleep",
    "octopuses",
    "the Silk Road",
    "recycling",
    "lighthouses",
    "the immune system",
    "robots",
    "tea",
    "deserts",
)
COUNTRIES = (
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "India",
    "Kenya",
    "Norway",
    "Peru",
    "Spain",
    "Italy",
    "Mexico",
    "Germany",
    "China",
    "Chile",
    "Greece",
    "Turkey",
    "Vietnam",
    "Poland",
    "Ghana",
)
TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "merges two sorted lists",
    "counts the words in a file",
    "computes the Fibonacci numbers",
    "parses a CSV line",
    "finds the largest element of a list",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "validates an email address",
)
# (kind, template): each kind asks for answers of a typical length, whatever the prompt's own length
TEMPLATES = (
    ("word", "Answer with one word only: what is the capital of {country}?"),
    ("word", "Reply with a single number: how many continents are there?"),
    ("sentence", "In one sentence, what is {topic}?"),
    ("sentence", "Give a one-line definition of {topic}. No more than one sentence."),
    ("list", "List five short facts about {topic}, one per line."),
    ("poem", "Write a short poem of four lines about {topic}."),
    ("summary", "Summarize the following notes in one sentence.\n\n{passage}"),
    (
        "essay",
        "Write a long, detailed essay about {topic}: an introduction, at least four sections with headings, "
        "and a conclusion.",
    ),
    (
        "essay",
        "Explain {topic} to a student in depth. Cover its history, how it works, why it matters and open "
        "questions, with examples for each.",
    ),
    (
        "code",
        "Write a Python function that {task}. Then explain the code line by line and give three example "
        "calls with their outputs.",
    ),
)


def _passage(rng: np.random.Generator) -> str:
    topics = rng.choice(TOPICS, size=int(rng.integers(4, 12)))
    return "\n".join(
        f"- {t.capitalize()} is a subject that many people find interesting, and there is a lot to "
        f"say about its history and its role today."
        for t in topics
    )


def make_prompts(n: int, seed: int) -> list[tuple[str, str]]:
    """n (kind, prompt) pairs, templates and fillers drawn at random."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kind, template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
        out.append(
            (
                kind,
                template.format(
                    topic=rng.choice(TOPICS),
                    country=rng.choice(COUNTRIES),
                    task=rng.choice(TASKS),
                    passage=_passage(rng),
                ),
            )
        )
    return out


def _header(model: str, prompts: list[tuple[str, str]]) -> dict:
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return {"model": model, "max_tokens": FLAGS.max_tokens, "prompts": len(prompts), "prompts_sha": digest}


def read_trace(path: pathlib.Path, header: dict) -> list[dict] | None:
    """The trace written for exactly these settings, or None (absent, other settings, or damaged)."""
    try:
        lines = path.read_text().splitlines()
        rows = [json.loads(line) for line in lines[1:]]
        ok = (
            json.loads(lines[0]) == header
            and len(rows) == header["prompts"]
            and all(isinstance(r.get("ids"), list) and isinstance(r.get("output_len"), int) for r in rows)
        )
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return rows if ok else None


def build_trace(model: str, prompts: list[tuple[str, str]], path: pathlib.Path) -> list[dict]:
    from jaxserve.api import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(model, max_num_seqs=32, max_model_len=2048, progress=True)
    t0 = time.perf_counter()
    convs = [[{"role": "user", "content": p}] for _, p in prompts]
    done = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens))
    print(f"answered {len(done)} prompts in {time.perf_counter() - t0:.0f} s")
    rows = [{"kind": k, "ids": c.prompt_token_ids, "output_len": len(c.token_ids)} for (k, _), c in zip(prompts, done)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(x) for x in [_header(model, prompts), *rows]) + "\n")
    return rows


def evaluate(trace: list[dict], features) -> dict:
    """Each predictor taught on the training split in order, then scored on the held-out rest."""
    from jaxserve.sched.decode_dispatch import BucketPredictor, ObservedLengths, PromptInfo, accuracy
    from jaxserve.sched.length_classifier import PromptClassifier

    g = FLAGS.granularity
    order = np.random.default_rng(FLAGS.seed + 1).permutation(len(trace))
    rows = [trace[i] for i in order]
    prompts = [PromptInfo(len(r["ids"]), features(r["ids"])) for r in rows]
    outputs = [r["output_len"] for r in rows]
    cut = int(len(rows) * FLAGS.train)
    classifier, mean = PromptClassifier(len(prompts[0].features), granularity=g), ObservedLengths(granularity=g)
    for p, o in zip(prompts[:cut], outputs[:cut]):
        classifier.observe(p, o)
        mean.observe(p, o)
    band = BucketPredictor.fit([p.length for p in prompts[:cut]], outputs[:cut], granularity=g)
    held, truth = prompts[cut:], outputs[cut:]

    def under(predictor) -> float:  # decodes longer than the predicted range: what a reservation misses
        return float(np.mean([o >= predictor.predict(p)[1] for p, o in zip(held, truth)]))

    kinds = sorted({r["kind"] for r in rows})
    result = {
        "requests": len(rows),
        "train": cut,
        "held_out": len(held),
        "granularity": g,
        "buckets_held_out": np.bincount(np.minimum(np.array(truth) // g, 7)).tolist(),
        "predictors": {},
    }
    for name, predictor in (("prompt classifier", classifier), ("running mean", mean), ("prompt-length bands", band)):
        per_kind = {
            k: accuracy(
                predictor,
                [p for p, r in zip(held, rows[cut:]) if r["kind"] == k],
                [o for o, r in zip(truth, rows[cut:]) if r["kind"] == k],
            )
            for k in kinds
        }
        result["predictors"][name] = {
            "accuracy": accuracy(predictor, held, truth),
            "under": under(predictor),
            "per_kind": per_kind,
        }
    return result


def table(result: dict) -> str:
    kinds = list(next(iter(result["predictors"].values()))["per_kind"])
    lines = [
        f"| predictor | accuracy | decode past the range | {' | '.join(kinds)} |",
        "|---|---:|---:|" + "---:|" * len(kinds),
    ]
    for name, r in result["predictors"].items():
        lines.append(
            f"| {name} | {r['accuracy']:.2f} | {r['under']:.2f} | "
            + " | ".join(f"{r['per_kind'][k]:.2f}" for k in kinds)
            + " |"
        )
    return "\n".join(lines)


def main(argv) -> None:
    del argv
    from jaxserve.cluster.length_predictor import PromptFeatures
    from jaxserve.models import registry
    from jaxserve.models.loader import load_weights

    model = FLAGS.model or registry.DEFAULT_MODEL
    out = pathlib.Path(FLAGS.out)
    prompts = make_prompts(FLAGS.prompts, FLAGS.seed)
    trace = read_trace(out / "trace.jsonl", _header(model, prompts)) or build_trace(model, prompts, out / "trace.jsonl")
    lengths = np.array([r["output_len"] for r in trace])
    print(
        f"{len(trace)} requests; decode lengths: mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
        f"{np.mean(lengths >= FLAGS.max_tokens):.0%} cut at --max_tokens={FLAGS.max_tokens}"
    )
    _, params, _ = load_weights(model, "float32")
    result = evaluate(trace, PromptFeatures(params))
    result |= {"model": model, "max_tokens": FLAGS.max_tokens}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(
        f"held out {result['held_out']} of {result['requests']}; {FLAGS.granularity}-token buckets; true buckets "
        f"{result['buckets_held_out']}"
    )
    print(table(result))


if __name__ == "__main__":
    app.run(main)
