#!/usr/bin/env bash
# The GPU checks and benchmarks in one run, on a machine whose python3 has JAX with CUDA (no download needed):
# (a lent GPU's image lacks qwix and gguf: carry their wheels, py3-none-any, and put them on PYTHONPATH first)
#   OUT=bench_out/gpu bash tools/checks/gpu.sh [kernels] [attention] [generate]
# kernels: the kernel tests, compiled through Triton (tests/pallas_kernels/kernel_check.py); ragged: the engine's kernel's alone;
# attention: tools/bench/attention.py;
# generate: tools/bench/generate.py --gpu on random Llama-3.1-8B weights (burst: the same with multi-step decodes of
# up to 8 steps; extras: the same beside every request with penalties and logprobs; structured: beside every request
# under a JSON schema, with the tokenizer folder $TOKENIZER); step: tools/profile/step.py (one decode
# step of it under jax.profiler, at batch 1 and 16: its top kernels, with each trace kept); profile:
# tools/profile/attention.py (the simulator's measured attention); quant: tools/bench/quantization.py on random
# Llama-3.1-8B in bfloat16, kept int8, int4 and fp8 beside it (bytes, decode / prefill tokens/s); quantmm:
# tools/bench/quant_matmul.py (one quantized weight's matmul, computed each way). One log ($OUT/checks.log), JSON and CSV go to
# $OUT, few files, as a lent GPU machine returns at most 8. Timeouts fit the three serving parts in one 10-minute call.
set -u
OUT=${OUT:-bench_out/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
parts=${*:-kernels attention generate}
exec > >(tee "$OUT/checks.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
$PY -c "import jax, jaxserve; print('jax', jax.__version__, jax.devices())"
status=0
for part in $parts; do
  case $part in
    kernels) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_kernels.py tests/pallas_kernels/test_ragged_paged_attention.py ;;
    ragged) timeout 200 $PY -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_ragged_paged_attention.py ;;
    attention) timeout 240 $PY tools/bench/attention.py --out="$OUT/attention.json" ;;
    generate) timeout 210 $PY tools/bench/generate.py --gpu --gpu_models=random:llama3-8b --out="$OUT/generate_gpu.json" ;;
    extras) timeout 420 $PY tools/bench/generate.py --gpu --gpu_models=random:llama3-8b --extras \
      --out="$OUT/generate_gpu_extras.json" ;;
    structured) timeout 420 $PY tools/bench/generate.py --gpu --gpu_models=random:llama3-8b --structured \
      --tokenizer="${TOKENIZER:?structured needs TOKENIZER, a tokenizer folder}" --out="$OUT/generate_gpu_structured.json" ;;
    burst) timeout 150 $PY tools/bench/generate.py --gpu --gpu_models=random:llama3-8b --num_scheduler_steps=8 \
      --out="$OUT/generate_gpu_burst.json" ;;
    step) rm -rf /tmp/step_profile; timeout 170 $PY tools/profile/step.py --model=random:llama3-8b --out=/tmp/step_profile &&
      cp /tmp/step_profile/summary.json "$OUT/step_summary.json" &&
      for b in b1 b16; do cp "$(find /tmp/step_profile/$b -name perfetto_trace.json.gz)" "$OUT/step_$b.json.gz"; done ;;
    quant) timeout 400 $PY tools/bench/quantization.py --model=random:llama3-8b --dtype=bfloat16 \
      --methods=int8,int4,fp8 --repeats=2 --out="$OUT/quantization.json" ;;
    quantmm) timeout 120 $PY tools/bench/quant_matmul.py ;;
    profile) timeout 270 $PY tools/profile/attention.py --out="$OUT/h100_attention.csv" ;;
    *) echo "unknown part $part"; false ;;
  esac
  rc=$?
  echo "== $part: exit $rc"
  [ "$rc" = 0 ] || status=1
done
exit $status
