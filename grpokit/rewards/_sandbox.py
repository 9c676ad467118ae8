"""Parent side of the code sandbox: choose the isolation layers once, run one job, read its
capped output and turn the event stream into a `CodeResult`.

The layers, strongest first (docs/rewards.md, "Sandbox threat model", says what each one stops):

- rlimits + own session (always): CPU seconds, address space, processes, file size, open files,
  no core dumps; wall-clock kill; scrubbed environment; stdout/stderr capped.
- user namespace (only when not root): lets an unprivileged trainer create the namespaces below.
- mount namespace: the whole filesystem read-only, the trainer's home hidden under an empty
  tmpfs, a private size-limited tmpfs as /tmp (the working directory), a fresh /proc.
- pid namespace: the program is pid 1 of its own namespace, sees no other process, and every
  process it starts dies with it (daemons and double forks included).
- network namespace (+ IPC, UTS): no interface but a down loopback, so no network at all.
- sandbox uid (only when root): a distinct unprivileged uid per run, so RLIMIT_NPROC actually
  binds, root-only files are unreadable and the trainer cannot be signalled.
- no capabilities (always): without a sandbox uid the program is root in its namespaces (or a
  root trainer's uid 0); every capability is dropped and locked away so it cannot remount.

`isolation()` probes the candidates once, strongest first, by running a real job under each, and
logs one warning naming what is missing when it had to fall back.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import _sandbox_launcher as _launcher

logger = logging.getLogger("grpokit.rewards")

LAUNCHER = os.path.abspath(_launcher.__file__)
STARTUP_TIMEOUT_S = 30.0  # interpreter start + namespace setup, before the program's clock starts
DRAIN_LIMIT = 8 * 2**20  # bytes of stdout/stderr read (and discarded past the cap) before closing
EVENTS_LIMIT = 2**20  # bytes of result events accepted from one run


@dataclass(frozen=True)
class Isolation:
    """The layers in force for every sandboxed run of this process."""

    mode: str  # "namespaces+uid" | "namespaces" | "uid" | "rlimits"
    userns: bool = False
    mountns: bool = False
    pidns: bool = False
    netns: bool = False
    uid_drop: bool = False
    missing: tuple[str, ...] = field(default_factory=tuple)

    def layers(self) -> dict:
        return {"userns": self.userns, "mountns": self.mountns, "pidns": self.pidns,
                "netns": self.netns, "uid_drop": self.uid_drop}


_WEAKER = {
    "mountns": "no mount namespace: the program can write wherever its uid may (no read-only "
    "filesystem, no private /tmp)",
    "pidns": "no pid namespace: detached processes are only reaped by uid or by an environment "
    "marker, and other processes are visible",
    "netns": "no network namespace: the program can open network connections",
    "uid_drop": "no separate uid: RLIMIT_NPROC does not bind for root, and the program can "
    "signal or read processes and files of the trainer's uid",
}


def _candidates() -> list[Isolation]:
    root = os.geteuid() == 0
    ns = dict(userns=not root, mountns=True, pidns=True, netns=True)
    out = []
    if root:
        out.append(Isolation("namespaces+uid", uid_drop=True, **ns))
    out.append(Isolation("namespaces", **ns))
    if root:
        out.append(Isolation("uid", uid_drop=True))
    out.append(Isolation("rlimits"))
    return out


def _with_missing(iso: Isolation) -> Isolation:
    want = {"mountns", "pidns", "netns", "uid_drop"} if os.geteuid() == 0 else {"mountns", "pidns", "netns"}
    have = iso.layers()
    missing = tuple(_WEAKER[k] for k in sorted(want) if not have[k])
    return Isolation(iso.mode, iso.userns, iso.mountns, iso.pidns, iso.netns, iso.uid_drop, missing)


_iso_lock = threading.Lock()
_iso: list[Isolation] = []

_PROBE_PROGRAM = "import decimal, fractions, json\nx = fractions.Fraction(1, 2)\n"
_PROBE_TESTS = "open('probe.txt', 'w').write('ok')\nassert open('probe.txt').read() == 'ok'\nassert x == 0.5\n"


def isolation() -> Isolation:
    """Probe (once per process) and return the strongest isolation that works here.

    `GRPOKIT_SANDBOX_MODE=<mode>` forces a mode (one of the `Isolation.mode` values).
    """
    with _iso_lock:
        if _iso:
            return _iso[0]
        forced = os.environ.get("GRPOKIT_SANDBOX_MODE", "auto")
        cands = _candidates()
        if forced != "auto":
            cands = [c for c in cands if c.mode == forced] or cands
        chosen, reasons = None, []
        for cand in cands:
            res = run_job(_PROBE_PROGRAM, _PROBE_TESTS, iso=cand, timeout_s=10.0, memory_mb=512,
                          nproc=32, file_mb=1, disk_mb=8, output_cap=2000, site=False)
            if res.status == "ok":
                chosen = _with_missing(cand)
                break
            reasons.append(f"{cand.mode}: {res.status} {res.detail or res.stderr[-200:]}")
        if chosen is None:  # nothing ran cleanly; keep the weakest so failures show per job
            chosen = _with_missing(cands[-1])
        if chosen.missing:
            logger.warning("grpokit code sandbox runs with weaker isolation (%s): %s%s", chosen.mode,
                           "; ".join(chosen.missing), (" [probe: " + " | ".join(reasons) + "]") if reasons else "")
        _iso.append(chosen)
        return chosen


def set_isolation(mode: str | None) -> Isolation | None:
    """Force a mode for this process (tests of the fallbacks); None re-probes on next use."""
    with _iso_lock:
        _iso.clear()
        if mode is None:
            return None
        for c in _candidates():
            if c.mode == mode:
                _iso.append(_with_missing(c))
                return _iso[0]
    raise ValueError(f"unknown or unavailable sandbox mode {mode!r}; options: {[c.mode for c in _candidates()]}")


@dataclass(frozen=True)
class CodeResult:
    """Outcome of one sandboxed run.

    status: "ok" (every test passed), "failed" (ran, some test failed), "timeout" (wall clock or
    CPU limit), "memory" (memory limit), "crashed" (the program did not compile, raised or exited
    before the tests ran, or died), "error" (it could not be run: bad tests, sandbox failure).
    """

    passed: int
    total: int
    status: str
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    detail: str = ""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class _Capped:
    def __init__(self, cap: int):
        self.cap, self.buf, self.seen = cap, bytearray(), 0

    def add(self, data: bytes) -> None:
        self.seen += len(data)
        room = self.cap - len(self.buf)
        if room > 0:
            self.buf += data[:room]

    def text(self) -> str:
        s = self.buf.decode("utf-8", "replace")
        return s + (f"\n[... {self.seen - len(self.buf)} more bytes dropped]" if self.seen > len(self.buf) else "")


def count_tests(tests) -> tuple[str, int]:
    """("io" | "assert", number of tests); raises ValueError for tests that cannot be used."""
    cases = _launcher.parse_io_tests(tests)
    if cases is not None:
        return "io", len(cases)
    if not isinstance(tests, str):
        raise ValueError(f"tests must be a Python script or stdin/stdout cases, got {type(tests).__name__}")
    try:
        units = _launcher.split_tests(tests)
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"tests do not parse: {e}") from None
    return "assert", sum(1 for is_test, _ in units if is_test)


def run_job(program: str, tests, *, iso: Isolation | None = None, timeout_s: float = 5.0,
            memory_mb: int = 512, nproc: int = 32, file_mb: int = 16, disk_mb: int = 64,
            output_cap: int = 16384, site: bool = True) -> CodeResult:
    """Run `program` against `tests` in a fresh sandbox; never raises for anything the program does."""
    t0 = time.monotonic()
    try:
        mode, total = count_tests(tests)
    except ValueError as e:
        return CodeResult(0, 0, "error", detail=str(e))
    if not isinstance(program, str):
        return CodeResult(0, total, "error", detail="program must be a string")
    iso = iso or isolation()
    token = f"{os.getpid()}-{uuid.uuid4().hex}"  # in every sandboxed environment: whose run it is
    hostdir = None if iso.mountns else tempfile.mkdtemp(prefix=f"grpokit-sbx-{os.getpid()}-")
    workdir = _launcher.SANDBOX_DIR if iso.mountns else hostdir
    cfg = {
        "program": program, "tests": tests, "mode": mode, "timeout_s": timeout_s, "memory_mb": memory_mb,
        "nproc": nproc, "file_mb": file_mb, "disk_mb": disk_mb, "output_cap": output_cap, "site": site,
        "workdir": workdir, "token": token, "expose": _expose_paths(), "hide": [os.path.expanduser("~")],
        "parent_pid": os.getpid(),
        "startup_s": STARTUP_TIMEOUT_S,
        "layers": {"userns": iso.userns, "mountns": iso.mountns, "pidns": iso.pidns,
                   "netns": iso.netns, "uid": iso.uid_drop},
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRPOKIT_SANDBOX": token}
    try:
        return _execute(cfg, env, total, timeout_s, output_cap, t0)
    finally:
        if hostdir:
            shutil.rmtree(hostdir, ignore_errors=True)


def _expose_paths() -> list[str]:
    """What a sandbox uid must be able to read: the interpreter, its stdlib and site-packages."""
    import site

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.__file__), *site.getsitepackages()}
    return sorted(p for p in paths if p and os.path.isdir(p))


def _execute(cfg: dict, env: dict, total: int, timeout_s: float, cap: int, t0: float) -> CodeResult:
    r_fd, w_fd = os.pipe()
    cfg["result_fd"] = w_fd
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(w_fd,), start_new_session=True, env=env, cwd="/",
        )
    except OSError as e:
        os.close(r_fd)
        os.close(w_fd)
        return CodeResult(0, total, "error", detail=f"cannot start the sandbox: {e}")
    os.close(w_fd)
    payload = memoryview(json.dumps(cfg).encode())
    out, err, events = _Capped(cap), _Capped(cap), bytearray()
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, r_fd: None}
    sel = selectors.DefaultSelector()
    in_fd = proc.stdin.fileno()
    os.set_blocking(in_fd, False)
    sel.register(in_fd, selectors.EVENT_WRITE)
    for fd in sinks:
        sel.register(fd, selectors.EVENT_READ)
    try:
        pidfd = os.pidfd_open(proc.pid)  # readable when the launcher exits (Linux >= 5.3)
        sel.register(pidfd, selectors.EVENT_READ)
    except (AttributeError, OSError):
        pidfd = None
    started_at, timed_out, killed_at = None, False, None
    spawn_deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if started_at is None and _START in events:
                started_at = now
            deadline = started_at + timeout_s if started_at is not None else spawn_deadline
            if killed_at is None and now >= deadline:
                timed_out, killed_at = started_at is not None, now
                _signal(proc, signal.SIGTERM)  # the launcher kills its child, cleans up, exits
            elif killed_at is not None and now - killed_at > 2.0:
                _kill_group(proc)
            wait = deadline - now if killed_at is None else 0.1
            for key, _ in sel.select(timeout=max(0.001, min(wait, 0.05 if pidfd is None else wait))):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(fd)
                elif fd == in_fd and not proc.stdin.closed:
                    try:
                        payload = payload[os.write(fd, payload):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        payload = payload[:0]
                    if not payload:
                        sel.unregister(fd)
                        proc.stdin.close()
                elif not _pump(fd, sinks[fd], events):
                    sel.unregister(fd)
                    if sinks[fd] is not None and sinks[fd].seen > DRAIN_LIMIT:
                        (proc.stdout if sinks[fd] is out else proc.stderr).close()  # writer: EPIPE
        # The launcher is gone. With a pid namespace so is everything it started; without one a
        # leftover may still hold the pipes open, so only take what is already buffered.
        for fd, sink in sinks.items():
            if fd in sel.get_map():
                os.set_blocking(fd, False)
                for _ in range(256):
                    if not _pump(fd, sink, events):
                        break
    finally:
        sel.close()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
        os.close(r_fd)
        if pidfd is not None:
            os.close(pidfd)
    return _result(events, proc.returncode, timed_out, killed_at is not None, total, out, err, t0)


_START = b'{"ev": "start"}'


def _pump(fd: int, sink: _Capped | None, events: bytearray) -> bool:
    """Move what is readable on `fd` into its sink; False once the stream should be dropped
    (end of file, or a flood past the drain limit: closing makes the writer fail with EPIPE)."""
    try:
        data = os.read(fd, 65536)
    except OSError:  # BlockingIOError included: nothing more buffered
        return False
    if not data:
        return False
    if sink is None:
        events += data
        return len(events) <= EVENTS_LIMIT
    sink.add(data)
    return sink.seen <= DRAIN_LIMIT


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except OSError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _result(events: bytearray, rc: int | None, timed_out: bool, killed: bool, total: int,
            out: _Capped, err: _Capped, t0: float) -> CodeResult:
    passed, done, saw_pid, setup_error, harness_error = set(), None, False, None, None
    for line in bytes(events).splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        kind = ev.get("ev")
        if kind == "pid":
            saw_pid = True
        elif kind == "setup_error" and setup_error is None:
            setup_error = str(ev.get("msg", ""))
        elif kind == "harness_error" and harness_error is None:
            harness_error = str(ev.get("msg", ""))
        elif kind == "test":
            i = ev.get("i")
            if type(i) is int and 0 <= i < total and ev.get("ok") is True:
                passed.add(i)
        elif kind == "done" and done is None:
            done = ev
    n = len(passed)
    dur = time.monotonic() - t0
    mk = lambda status, detail="": CodeResult(n, total, status, out.text(), err.text(), dur, detail)  # noqa: E731
    if timed_out:
        return mk("timeout", "wall-clock limit")
    if not saw_pid:
        return mk("error", setup_error or f"sandbox did not start (exit {rc})" + (" (startup timeout)" if killed else ""))
    if done is not None:
        status = done.get("status")
        if status not in ("ok", "failed", "memory", "crashed"):
            status = "crashed"
        if status == "ok" and n != total:
            status = "failed"
        return mk(status, str(done.get("msg", ""))[:500])
    if rc is not None and rc - 128 == signal.SIGXCPU:
        return mk("timeout", "CPU-time limit")
    if harness_error and "MemoryError" in harness_error:
        return mk("memory", harness_error)
    sig = rc - 128 if rc is not None and rc > 128 else None
    return mk("crashed", harness_error or (f"killed by signal {sig}" if sig else f"exited with code {rc} before reporting"))
