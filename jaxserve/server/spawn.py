"""`python -m jaxserve serve` as a child process, for benchmarks and tests: started, waited for until both
interfaces listen (the launcher prints one line then), and stopped with SIGTERM, which drains.

    with ServerProcess("--max_model_len=2048") as s:
        openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="-")
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_LISTENING = re.compile(r"gRPC on 127\.0\.0\.1:(\d+), HTTP on http://127\.0\.0\.1:(\d+)")


class ServerProcess:
    def __init__(self, *flags: str, pythonpath: str | None = None):
        """flags: `serve` flags after the free ports (--grpc_port=0 --http_port=0, which a flag may override).
        pythonpath: run the jaxserve found there first (e.g. a worktree of an older commit). The server's log
        goes to a temporary file (a pipe nobody reads could fill and stall it): `log()` reads it."""
        self._log = tempfile.TemporaryFile("w+")
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "serve", "--grpc_port=0", "--http_port=0", *flags],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline()
        match = _LISTENING.search(line)
        if not match:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the server did not start: {line!r}\n{self.log()}")
        self.grpc_port, self.http_port = int(match[1]), int(match[2])

    def metrics(self) -> dict[str, float]:
        """The server's /metrics samples without labels (gauges, counters, histogram sums), by name."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=30).read().decode()
        return {
            s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels
        }

    def log(self) -> str:
        """What the server has written to stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (drain), then SIGKILL after `timeout` seconds; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
