"""The papers' claims in simulation, by name: the registry `python -m jaxserve.lab NAME`
(lab/__main__.py) and the smoke test run.

    from jaxserve.lab import experiments
    results = experiments.run("cdsp", tiny=True, out="/tmp/cdsp")  # prints, writes JSON and plots, returns the JSON

Each experiment (lab/claims/) defines its named systems against their controls, its Options (the command line's
flags) and TINY, the small set-up the smoke test runs.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from jaxserve.lab.claims import cdsp, csps, esp, kvp, policies, tetriinfer, tetris_tbt

EXPERIMENTS: dict[str, ModuleType] = {
    "cdsp": cdsp,
    "csps": csps,
    "esp": esp,
    "kvp": kvp,
    "policies": policies,
    "tetriinfer": tetriinfer,
    "tetris_tbt": tetris_tbt,
}


def option_names(name: str) -> tuple[str, ...]:
    """The experiment's options: its command line's flags."""
    return tuple(f.name for f in dataclasses.fields(EXPERIMENTS[name].Options))


def run(name: str, tiny: bool = False, **options: Any) -> dict:
    """Runs one experiment with its defaults (its tiny set-up if `tiny`), `options` replacing some of them."""
    claim = EXPERIMENTS[name]
    return claim.run(dataclasses.replace(claim.TINY if tiny else claim.Options(), **options))
