"""Compiling for GPUs without one: the ring's K/V transfers overlap attention in the compiled schedule.

tools/checks/gpu_compile.py compiles the ring step and the engine's CDSP chunk step for 8 (and 2) H100s described by a
target config, through JAX's CUDA plugin without CUDA libraries (tools/install.sh puts it in .venv/cuda-compiler),
in its own process so that this one never loads the plugin. The schedule reader is tested on hand-written HLO.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from jaxserve import xla_flags
from jaxserve.engine import compiled
from jaxserve.sharding import overlap

ROOT = pathlib.Path(__file__).resolve().parents[2]

_HLO = """\
%body (p: (s32[], bf16[64,128])) -> (s32[], bf16[64,128]) {
  %p = (s32[], bf16[64,128]{1,0}) parameter(0)
  %a = bf16[64,128]{1,0} get-tuple-element(%p), index=1
  %k = bf16[64,128]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %t = (s32[], bf16[64,128]{1,0}) tuple(%i, %k)
}

ENTRY %main (x: bf16[1024,8,128]) -> bf16[1024,8,128] {
  %x = bf16[1024,8,128]{2,1,0} parameter(0)
  %cps = (bf16[1024,8,128]{2,1,0}, bf16[1024,8,128]{2,1,0}) collective-permute-start(%x), channel_id=1, backend_config={"collective_backend_config":{"is_sync":true}}
  %cpd = bf16[1024,8,128]{2,1,0} collective-permute-done(%cps)
  %cps.1 = (bf16[1024,8,128]{2,1,0}, bf16[1024,8,128]{2,1,0}) collective-permute-start(%cpd), channel_id=2, backend_config={"collective_backend_config":{"is_sync":false}}
  %w = (s32[], bf16[64,128]{1,0}) while(%init), condition=%cond, body=%body
  %f = bf16[64,128]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %cpd.1 = bf16[1024,8,128]{2,1,0} collective-permute-done(%cps.1)
  %cps.2 = (bf16[1024,8,128]{2,1,0}, bf16[1024,8,128]{2,1,0}) collective-permute-start(%cpd.1), channel_id=3
  %f.2 = bf16[64,128]{1,0} fusion(%x), kind=kLoop, calls=%fused
  ROOT %cpd.2 = bf16[1024,8,128]{2,1,0} collective-permute-done(%cps.2)
  %s32 = s32[16]{0} collective-permute(%y), channel_id=4
}
"""


def test_schedule_reader_finds_what_runs_during_each_transfer():
    found = {t.name: t for t in overlap.transfers(_HLO)}
    assert set(found) == {"cps", "cps.1", "cps.2", "s32"}
    assert found["cps"].bytes == 1024 * 8 * 128 * 2
    assert not found["cps"].asynchronous and not found["cps"].overlapped  # XLA kept it on the compute stream
    assert found["cps.1"].kernels_in_flight == 1 and found["cps.1"].overlapped  # the kernel inside the loop
    assert found["cps.2"].asynchronous and not found["cps.2"].overlapped  # only a fusion, no attention kernel
    assert found["s32"].bytes == 64 and not found["s32"].overlapped


def _run(tmp_path: pathlib.Path, *flags: str) -> dict:
    plugin = pathlib.Path(sys.prefix) / "cuda-compiler"
    if not plugin.is_dir():
        pytest.fail(f"{plugin} is missing: tools/install.sh installs JAX's CUDA plugin there for this test")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/checks/gpu_compile.py"), f"--out={tmp_path}", *flags],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads((tmp_path / "summary.json").read_text())


@pytest.mark.parametrize("sp", [8, 2])
def test_every_ring_transfer_of_kv_overlaps_attention_on_h100s(tmp_path, sp):
    summary = _run(tmp_path, f"--sp={sp}", "--tokens=4096", "--history=4096")
    assert summary["compiler_options"] == xla_flags.compiler_options()  # the launcher's flags
    for program in ("ring", "chunk"):
        kv = [t for t in summary[program] if t["bytes"] >= 1 << 16]
        # one transfer of the stacked K/V per ring step but the last (per layer, the layers being one loop body)
        assert len(kv) == sp - 1, summary[program]
        assert all(t["asynchronous"] and t["kernels_in_flight"] >= 1 for t in kv), summary[program]
        assert kv[0]["bytes"] == 2 * (4096 // sp) * 8 * 128 * 2  # K and V of one shard, bf16
        assert (tmp_path / f"{program}.hlo").read_text().count('"__gpu$xla.gpu.triton"') > 0


_STEP_HLO = """\
%fused_slice (p0: bf16[32,64,128], p1: s32[]) -> bf16[1,64,128] {
  %p0 = bf16[32,64,128]{2,1,0} parameter(0)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,128}
}

%body (p: (s32[], bf16[32,64,128])) -> (s32[], bf16[32,64,128]) {
  %p = (s32[], bf16[32,64,128]{2,1,0}) parameter(0)
  %w = bf16[32,64,128]{2,1,0} get-tuple-element(%p), index=1
  %copy = bf16[1,64,128]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  ROOT %t = (s32[], bf16[32,64,128]{2,1,0}) tuple(%i, %w)
}

ENTRY %main (x: bf16[64,128]) -> bf16[16,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %loop = (s32[], bf16[32,64,128]{2,1,0}) while(%init), condition=%cond, body=%body
  %branch = bf16[16,128]{1,0} conditional(%pred, %a, %b), branch_computations={%t, %f}
  ROOT %dot = bf16[16,128]{1,0} fusion(%y, %x), kind=kCustom, calls=%fused_slice
}
"""


def test_step_reader_finds_weight_copies_and_branches():
    found = compiled.read_step(_STEP_HLO, [(64, 128), (128, 4096)])
    assert found["conditionals"] == 1 and found["whiles"] == 1
    # the loop body's slice of the stacked weights is its own buffer; the weight parameter itself is not a copy,
    # and a fusion's insides (the slice's computation) are not read
    assert found["weight_copies"] == ["copy: fusion bf16[1,64,128]{2,1,0}"]


def test_step_reader_finds_a_weight_dequantized_in_blocks():
    hlo = """\
ENTRY %main (v: u8[64,64], s: f16[2,128]) -> bf16[16,128] {
  %v = u8[64,64]{1,0} parameter(0)
  %u = u4[64,64,2]{2,1,0} bitcast(%v)
  %w = bf16[2,32,128]{2,1,0} fusion(%u, %s), kind=kLoop, calls=%dequantize
  %i = s8[2,32,128]{2,1,0} fusion(%u), kind=kLoop, calls=%widen
  ROOT %dot = bf16[16,128]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
}
"""
    found = compiled.read_step(hlo, [(64, 128)])
    # the float [blocks, 32, n] buffer holds the weight's elements; the packed and integer views are not copies
    assert found["weight_copies"] == ["w: fusion bf16[2,32,128]{2,1,0}"]


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_the_quantized_decode_step_for_an_h100_never_writes_a_dequantized_weight(tmp_path, method):
    """Weights kept quantized: the GEMMs read the stored values (converted in the operand read) and scale their
    output, a scale per column (int8, fp8) or per block of 128 inputs (int4: a GEMM per block, XLA's int4 values,
    q/k/v not merged into one GEMM); no weight is dequantized into a buffer of its own first. On an H200 that
    buffer made a quantized decode step 3x slower than bf16's (docs/BENCHMARKS.md). Two layers and the LM head;
    a layer's program is the same at 32."""
    summary = _run(tmp_path, "--decode", "--decode_layers=2", f"--quantization={method}")
    assert summary["quantization"] == method
    assert ("xla_gpu_dot_merger_threshold_mb" in summary["compiler_options"]) == (method == "int4")
    for rows in (1, 16):
        for program in ("decode", "burst"):
            found = summary[f"{program}_b{rows}"]
            assert found["conditionals"] == 0 and found["weight_copies"] == [], found


def test_the_decode_step_for_an_h100_reads_weights_in_place_and_never_branches(tmp_path):
    """The pure-decode serving step of Llama-3.1-8B (32 layers, bf16), compiled for one H100: no weight copied out
    of a stacked array, no conditional (so no host sync inside the step), at batch 1 and 16; its samplers (of
    each kind) have no conditional either. Its multi-step decode is one loop (the step and the sampler inside),
    with no weight copied either."""
    summary = _run(tmp_path, "--decode")
    for rows in (1, 16):
        found = summary[f"decode_b{rows}"]
        assert found["conditionals"] == 0 and found["whiles"] == 0 and found["weight_copies"] == [], found
        found = summary[f"burst_b{rows}"]
        assert found["conditionals"] == 0 and found["whiles"] == 1 and found["weight_copies"] == [], found
        for name in ("decode", "burst"):  # no projection fused into the KV write (slow at one row)
            assert summary[f"{name}_b{rows}"]["scatters_reading_weights"] == [], summary[f"{name}_b{rows}"]
        for name in ("decode", "burst"):
            hlo = (tmp_path / f"{name}_b{rows}.hlo").read_text()
            assert hlo.count('"__gpu$xla.gpu.triton"') > 0  # the attention is the Pallas kernel
        for kind in ("greedy", "draw", "cut"):
            assert summary[f"sampler_b{rows}_{kind}"]["conditionals"] == 0
