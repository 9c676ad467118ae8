"""A `grpokit rollout-server` in a child process for tests: a free port chosen by the server itself
(`--port 0`, read back from its first line), bounded waits, and never left behind: killed when the
context ends, on failure too, and (Linux) when the test process itself dies."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120          # loading torch + transformers on a busy 2-core machine


def _die_with_parent() -> None:       # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *, threads: int = 1):
        self.model_dir, self.log_path, self.threads = model_dir, log_path, threads
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self) -> "ServerProcess":
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(self.threads)}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpokit.cli", "rollout-server", "--model", str(self.model_dir),
             "--port", "0", "--device", "cpu"], stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            m = re.search(r"listening on (\S+:\d+)", self.log_path.read_text())
            if m:
                self.address = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"rollout server exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"rollout server did not start within {START_TIMEOUT_S} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
