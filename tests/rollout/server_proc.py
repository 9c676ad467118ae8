"""Rollout servers for tests.

`ServerProcess`: a `grpokit rollout-server` in a child process, on a free port chosen by the server
itself (`--port 0`, read back from its first line), with bounded waits, and never left behind:
killed when the context ends, on failure too, and (Linux) when the test process itself dies.
`served`: the same server in a thread of the test process (the same HTTP and gloo code, without
the start-up cost). `raw_request`: one request as raw bytes over its own socket, for the tests that
send what no HTTP client would."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120          # loading torch + transformers on a busy 2-core machine


def _die_with_parent() -> None:       # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *, threads: int = 1, api_key: str | None = None,
                 args: tuple[str, ...] = ()):
        """`api_key`: given to the server in GRPOKIT_API_KEY; `args`: more flags of `rollout-server`."""
        self.model_dir, self.log_path, self.threads = model_dir, log_path, threads
        self.api_key, self.args = api_key, tuple(args)
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self) -> "ServerProcess":
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(self.threads)}
        env.pop("GRPOKIT_API_KEY", None)
        if self.api_key:
            env["GRPOKIT_API_KEY"] = self.api_key
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpokit.cli", "rollout-server", "--model", str(self.model_dir),
             "--port", "0", "--device", "cpu", *self.args], stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
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


@contextmanager
def served(model_dir: Path, *, api_key: str | None = None, limits=None, port: int = 0):
    """(address, service, httpd): a rollout server over its own copy of `model_dir`, in a thread of
    this process (on `port`, or a free one)."""
    from grpokit.models import load_model, load_tokenizer
    from grpokit.rollout.hf import HFEngine
    from grpokit.rollout.server import RolloutService, make_server

    model = load_model(model_dir, dtype="float32", device="cpu")
    model.eval()
    service = RolloutService(HFEngine(model, load_tokenizer(model_dir), owns_weights=True), host="127.0.0.1",
                             backend="hf", model=str(model_dir), device="cpu", vocab_size=model.config.vocab_size,
                             limits=limits)
    httpd = make_server(service, "127.0.0.1", port, api_key=api_key)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}", service, httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        service.close()
        thread.join(timeout=10)


def request(address: str, method: str, path: str, body=None, *, key: str | None = None,
            headers: dict | None = None, timeout: float = 60) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one request over http.client."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    hdrs = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    try:
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), dict(resp.getheaders())
    finally:
        conn.close()


def raw_request(address: str, data: bytes, *, shut_wr: bool = False, trickle: bytes = b"",
                trickle_every_s: float = 0.2, timeout: float = 30) -> tuple[int, dict]:
    """Send `data` as is (then `trickle`, a byte at a time every `trickle_every_s`, while the server
    still reads; then half-close if `shut_wr`) and read one HTTP answer: (status, JSON body), or
    (0, {}) when the server closed without answering."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        for b in trickle:
            time.sleep(trickle_every_s)
            try:
                sock.sendall(bytes([b]))
            except OSError:                  # the server gave up on us: read its answer
                break
        if shut_wr:
            sock.shutdown(socket.SHUT_WR)
        resp = http.client.HTTPResponse(sock)
        try:
            resp.begin()
        except (http.client.RemoteDisconnected, ConnectionError):
            return 0, {}
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"error": raw[:200].decode(errors="replace"), "kind": "not_json"}
