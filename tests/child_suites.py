"""Test folders run by pytest in child processes with their own CPU device counts. A module of its own, not
conftest.py: each test folder's conftest.py is imported as `conftest`, so a name imported from there would resolve
to whichever folder's was loaded last."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time


class ChildSuite:
    """One test folder run by pytest in a child process with `devices` CPU devices (XLA_FLAGS set for that process
    only) on `workers` pytest-xdist workers, at CPU priority `nice`; its output goes to a file."""

    def __init__(self, folder: str, devices: int, workers: int, nice: int = 0, timeout_s: float = 3600):
        self.folder, self.devices, self.workers, self.nice, self.timeout_s = folder, devices, workers, nice, timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is not None:
            return
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={self.devices}")
        parallel = ["-n", str(self.workers)] if self.workers > 1 else []
        self.log = tempfile.TemporaryFile("w+")
        self.deadline = time.monotonic() + self.timeout_s
        self.proc = subprocess.Popen(
            [
                "nice",
                "-n",
                str(self.nice),
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--durations=10",
                *parallel,
                str(pathlib.Path(__file__).parent / self.folder),
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(self) -> tuple[int, str]:
        """Wait for the run (starting it if need be): its exit status and the tail of its output."""
        self.start()
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.seek(0)
        return code, self.log.read()[-20000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


SHARDING = ChildSuite("sharding", devices=8, workers=2, nice=10)
