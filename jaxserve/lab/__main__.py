"""The papers' claims in simulation from the command line: `python -m jaxserve.lab NAME [--option=value ...]`.

    .venv/bin/python -m jaxserve.lab                          # the experiments, one line each
    .venv/bin/python -m jaxserve.lab cdsp --help              # what cdsp compares, and its options
    .venv/bin/python -m jaxserve.lab cdsp --requests=600 --out=docs/figures

Each experiment's options are the fields of its Options (lab/claims/NAME.py), with their defaults and its HELP;
it prints its tables and writes its JSON and plots to --out (lab/experiments.py runs it).
"""

from __future__ import annotations

import sys
import textwrap
from typing import Sequence

from absl import app, flags

from jaxserve.lab import experiments


def _define(name: str) -> None:
    """The experiment's options as absl flags: typed by their defaults, a sequence as a comma-separated list."""
    claim = experiments.EXPERIMENTS[name]
    defaults, choices = claim.Options(), getattr(claim, "CHOICES", {})
    for option in experiments.option_names(name):
        default, help_ = getattr(defaults, option), claim.HELP[option]
        if option in choices:
            flags.DEFINE_enum(option, default, choices[option], help_)
        elif isinstance(default, bool):
            flags.DEFINE_bool(option, default, help_)
        elif isinstance(default, int):
            flags.DEFINE_integer(option, default, help_)
        elif isinstance(default, float):
            flags.DEFINE_float(option, default, help_)
        elif isinstance(default, str):
            flags.DEFINE_string(option, default, help_)
        else:  # a sequence, or None (the experiment's own default)
            flags.DEFINE_list(option, None if default is None else list(default), help_)


def _listing() -> str:
    lines = ["usage: python -m jaxserve.lab NAME [--option=value ...] (--help: NAME's options)", ""]
    for name, claim in experiments.EXPERIMENTS.items():
        summary = " ".join((claim.__doc__ or "").strip().split("\n\n")[0].split())
        lines.append(f"  {name:<11} {textwrap.shorten(summary, 100, placeholder=' ...')}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2 or argv[1] not in experiments.EXPERIMENTS:
        if len(argv) >= 2 and not argv[1].startswith("-"):
            sys.exit(f"no experiment named {argv[1]!r}\n\n{_listing()}")
        print(_listing())
        return
    name = argv[1]
    _define(name)
    claim = experiments.EXPERIMENTS[name]
    # absl's --help prints the module docstring of __main__: this experiment's own
    sys.modules["__main__"].__doc__ = claim.__doc__

    def run(rest: Sequence[str]) -> None:
        if len(rest) > 1:
            raise app.UsageError(f"unexpected arguments: {' '.join(rest[1:])}")
        experiments.run(name, **{k: flags.FLAGS[k].value for k in experiments.option_names(name)})

    app.run(run, argv=[f"{argv[0]} {name}", *argv[2:]])


if __name__ == "__main__":
    main(sys.argv)
