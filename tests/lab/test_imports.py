"""The lab imports no jax, like the sched/ and sim/ it builds on."""

from __future__ import annotations

import subprocess
import sys


def test_no_module_of_the_lab_imports_jax():
    code = (
        "import importlib, pkgutil, sys, jaxserve.lab\n"
        "for m in pkgutil.walk_packages(jaxserve.lab.__path__, 'jaxserve.lab.'):\n"
        "    importlib.import_module(m.name)\n"
        "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'jax imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
