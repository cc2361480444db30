"""tools/profile_engine.py on a tiny grid: samples from the real engine, CSV columns, fits that load back."""

from __future__ import annotations

import csv
import pathlib
import sys

from jaxserve.sched.cost_models import Decode, TetrisPrefill

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tools"))
import profile_engine  # noqa: E402  (tools/ is not a package)

# History 16 (not more) keeps most points in shared block buckets: fewer compiles, so a cold run stays fast.
PREFILL = [(n, h) for n in (16, 32, 64, 128) for h in (0, 16)]
DECODE = [(b, kv) for b in (1, 2) for kv in (64, 128)]


def test_profile_writes_positive_samples_and_loadable_fits(llm, tmp_path):
    free = llm.engine.pool.num_free
    samples = profile_engine.profile(llm, PREFILL, DECODE, repeats=1)
    assert llm.engine.pool.num_free == free  # every block it took went back
    profile_engine.write(samples, tmp_path)

    with open(tmp_path / "samples.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["kind", "sp", "tp", "n", "h", "batch", "sum_kv", "seconds"]
    assert sorted((int(r["n"]), int(r["h"])) for r in rows if r["kind"] == "prefill") == sorted(PREFILL)
    assert sorted((int(r["batch"]), int(r["sum_kv"])) for r in rows if r["kind"] == "decode") == sorted(
        (b, b * kv) for b, kv in DECODE)
    assert all(float(r["seconds"]) > 0 for r in rows)

    prefill = TetrisPrefill.from_json((tmp_path / "tetris_prefill.json").read_text())
    decode = Decode.from_json((tmp_path / "decode.json").read_text())
    assert set(prefill.coefficients) == {1} and set(decode.coefficients) == {(1, 1)}
