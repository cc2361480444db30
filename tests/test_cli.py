"""The launcher, run as a user runs it: `python -m jaxserve generate ...` in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve import SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], capture_output=True, text=True, timeout=600)


def test_generate_prints_the_greedy_chat_reply(llm):
    prompt = "What is the capital of France?"
    proc = run_cli("generate", f"--prompt={prompt}", "--max_tokens=12", "--max_model_len=512")
    assert proc.returncode == 0, proc.stderr
    (expected,) = llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=12))
    assert proc.stdout == expected.text + "\n"
    assert "I1" not in proc.stderr  # library INFO logs stay quiet


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt="], "--prompt is required"),
        (["generate", "--prompt=hi", "--max_tokens=-1"], "max_tokens must be >= 1"),
        (["generate", "--prompt=hi", "--top_p=0"], "top_p must be in (0, 1]"),
        (["generate", "--prompt=hi", "--model=no-such-model"], "unknown model 'no-such-model'"),
        (["generate", "--prompt=hi", "--max_tokens=lots"], "max_tokens"),
        (["bogus"], "usage: python -m jaxserve"),
        (
            [
                "generate",
                "--prompt=hi",
                "--max_model_len=512",
                "--prefill_instances=4",
                "--decode_instances=2",
                "--decode_kvp=2",
            ],
            "the layout needs 8 devices (4 prefill + 2 decode x 2); there are 1",
        ),
        (
            ["generate", "--prompt=hi", "--max_model_len=512", "--prefill_instances=2", "--node_size=0"],
            "in nodes of one or more",
        ),
        (
            ["generate", "--prompt=hi", "--max_model_len=512", "--tp=2"],
            "tensor parallelism over 2 devices does not divide the model's 9 attention heads, 3 KV heads",
        ),
        (["generate", "--prompt=hi", "--max_model_len=512", "--tp=3"], "tp=3 needs 3 devices; there are 1"),
        (
            ["generate", "--prompt=hi", "--min_chunk=256"],
            "--min_chunk=256: not read with one engine (a cluster needs --prefill_instances); leave it out",
        ),
        (
            ["serve", "--prefill_instances=2", "--cluster_policy=esp", "--decode_instances=2"],
            "--decode_instances=2: not read with --cluster_policy=esp",
        ),
    ],
)
def test_bad_input_exits_with_a_message(args, message):
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gpu_xla_flags_only_with_the_cuda_plugin_and_never_over_the_users(monkeypatch):
    from jaxserve import xla_flags

    monkeypatch.setattr(xla_flags.importlib.util, "find_spec", lambda name: None)
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    xla_flags.for_gpu(env)
    assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}  # a CPU install: nothing added
    monkeypatch.setattr(xla_flags.importlib.util, "find_spec", lambda name: name == "jax_cuda12_plugin" or None)
    xla_flags.for_gpu(env)
    launcher = " ".join(xla_flags.GPU_XLA_FLAGS)
    assert "--xla_gpu_enable_command_buffer=" in launcher and launcher.endswith(",WHILE")  # bursts as CUDA graphs
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {launcher}"
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    xla_flags.for_gpu(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false " + launcher.split()[1]
    env = {}
    xla_flags.for_gpu(env)
    assert env["XLA_FLAGS"] == launcher


def test_cpu_options_widen_vectors_only_with_avx512_and_never_over_the_users(monkeypatch):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve import xla_flags

    monkeypatch.setattr(xla_flags, "_has_avx512", lambda: False)
    assert xla_flags.cpu_options() == {}
    monkeypatch.setattr(xla_flags, "_has_avx512", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=256")
    assert xla_flags.cpu_options() == {}
    monkeypatch.delenv("XLA_FLAGS")
    options = xla_flags.cpu_options()
    assert options == {"xla_cpu_prefer_vector_width": 512}
    # this XLA knows the option, and a GEMV compiled with it gives the same numbers
    x, w = (jnp.asarray(np.random.default_rng(0).standard_normal(s), jnp.float32) for s in ((1, 576), (576, 192)))
    lowered = jax.jit(jnp.matmul).lower(x, w)
    np.testing.assert_allclose(
        lowered.compile(compiler_options=options)(x, w),
        lowered.compile()(x, w),
        rtol=1e-5,
        atol=1e-5 * float(jnp.abs(x).sum()),
    )


def test_helpfull_lists_the_flags():
    proc = run_cli("--helpfull")  # absl prints the flags and exits 1 by design
    for flag in ("--prompt", "--model", "--max_tokens", "--temperature", "--top_p", "--seed"):
        assert flag in proc.stdout
