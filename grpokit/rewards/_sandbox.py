"""Parent side of the code sandbox: choose the isolation layers once, plan the tests, run one
job, read its capped output and judge the data it sends back into a `CodeResult`.

This process is the only judge: `plan_tests` keeps every expected value here and sends the
sandbox only what must run (setup statements, the expressions a test needs, stdin); `judge`
compares the plain values and outputs that come back ("Who decides a test passed" in
docs/rewards.md). The exception, always counted as untrusted: tests the tests' form leaves to the
sandbox, and tests whose value is not plain data (the program's own class), which a second run
of the program judges by running their asserts.

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
from ._judge import _warn_untrusted, judge, judge_redo
from ._testplan import TestPlan, plan_tests

logger = logging.getLogger("grpokit.rewards")

LAUNCHER = os.path.abspath(_launcher.__file__)
STARTUP_TIMEOUT_S = 30.0  # interpreter start + namespace setup, before the program's clock starts
DRAIN_LIMIT = 8 * 2**20  # bytes of stdout/stderr read (and discarded past the cap) before closing
DATA_LIMIT = 8 * 2**20  # bytes accepted on the launcher's and on the harness's channel of one run


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

_PROBE_PROGRAM = (
    "import decimal, fractions, json\nx = fractions.Fraction(1, 2)\n"
    "def probe():\n    with open('probe.txt', 'w') as f:\n        f.write('ok')\n"
    "    with open('probe.txt') as f:\n        return f.read()\n"
)
_PROBE_TESTS = "assert probe() == 'ok'\nassert x == 0.5\n"  # a write in the workdir, a stdlib type


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
    untrusted: how many of the `total` tests could not be judged by the trainer (their verdict
    comes from inside the sandbox, where a hostile program can forge it; see docs/rewards.md):
    those the tests' form leaves to the sandbox, and those whose value was not plain data;
    untrusted_passed: how many of `passed` are such tests. trusted_total: how many tests the
    trainer judges itself when the values are plain data, fixed by the tests alone whatever the
    program does (the denominator of `code_tests(trusted_only=True)`).
    """

    passed: int
    total: int
    status: str
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    detail: str = ""
    untrusted: int = 0
    untrusted_passed: int = 0
    trusted_total: int = 0
    failed_test: str = ""      # the first failing test, in a few words (`TestPlan.describe`)

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


def run_job(program: str, tests, *, iso: Isolation | None = None, timeout_s: float = 5.0,
            memory_mb: int = 512, nproc: int = 32, file_mb: int = 16, disk_mb: int = 64,
            output_cap: int = 16384, site: bool = True, objects_in_sandbox: bool = False) -> CodeResult:
    """Run `program` against `tests` in a fresh sandbox; never raises for anything the program
    does. A test whose value is not plain data (an object of the program's own class) fails,
    unless `objects_in_sandbox`: then the program runs a second time, in which such tests run their
    own asserts (their verdicts are then the sandbox's: untrusted). Off by default because the
    "not plain data" marker comes over a channel the program controls: a hostile program could
    send it for every test and then forge the second run's verdicts."""
    t0 = time.monotonic()
    try:
        plan = plan_tests(tests)
    except ValueError as e:
        return CodeResult(0, 0, "error", detail=str(e))
    except Exception as e:  # noqa: BLE001 - a bug in the planner must not stop the training run
        return CodeResult(0, 0, "error", detail=f"cannot plan the tests: {type(e).__name__}: {e}"[:500])
    if not isinstance(program, str):
        return CodeResult(0, plan.total, "error", detail="program must be a string", untrusted=plan.untrusted)
    if plan.untrusted:
        _warn_untrusted(plan)
    limits = {"iso": iso or isolation(), "timeout_s": timeout_s, "memory_mb": memory_mb, "nproc": nproc,
              "file_mb": file_mb, "disk_mb": disk_mb, "output_cap": output_cap, "site": site}
    run = _run_once(program, plan.mode, plan.steps, **limits)
    verdicts = judge(plan, run.replies)
    redo = [i for i, (ok, _) in enumerate(verdicts) if ok is None]
    if redo and not objects_in_sandbox:
        for i in redo:
            verdicts[i] = (False, f"{verdicts[i][1]} (objects_in_sandbox=True judges it in the sandbox, untrusted)")
        redo = []
    if redo and _label(run, False, "")[0] == "failed":  # the first run went through to the end
        second = _run_once(program, plan.mode, plan.redo_steps(redo), **limits)
        for i in redo:
            verdicts[i] = judge_redo(second.replies.get(i), verdicts[i][1])
    verdicts = [(bool(ok), why) for ok, why in verdicts]
    return _result(run, plan, verdicts, redo, t0)


def _run_once(program: str, mode: str, steps, *, iso: Isolation, timeout_s: float, memory_mb: int, nproc: int,
              file_mb: int, disk_mb: int, output_cap: int, site: bool) -> _Run:
    """One sandboxed run of `program` and `steps`, in a fresh working directory."""
    token = f"{os.getpid()}-{uuid.uuid4().hex}"  # in every sandboxed environment: whose run it is
    hostdir = None if iso.mountns else tempfile.mkdtemp(prefix=f"grpokit-sbx-{os.getpid()}-")
    workdir = _launcher.SANDBOX_DIR if iso.mountns else hostdir
    cfg = {  # no expected value of a test the parent judges is in here (see TestPlan)
        "program": program, "mode": mode, "steps": steps, "timeout_s": timeout_s,
        "memory_mb": memory_mb, "nproc": nproc, "file_mb": file_mb, "disk_mb": disk_mb, "output_cap": output_cap,
        "site": site, "workdir": workdir, "token": token, "expose": _expose_paths(),
        "hide": [os.path.expanduser("~")], "parent_pid": os.getpid(), "startup_s": STARTUP_TIMEOUT_S,
        "layers": {"userns": iso.userns, "mountns": iso.mountns, "pidns": iso.pidns,
                   "netns": iso.netns, "uid": iso.uid_drop},
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRPOKIT_SANDBOX": token}
    try:
        return _execute(cfg, env, timeout_s, output_cap)
    finally:
        if hostdir:
            shutil.rmtree(hostdir, ignore_errors=True)


def _expose_paths() -> list[str]:
    """What a sandbox uid must be able to read: the interpreter, its stdlib and site-packages."""
    import site

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             os.path.dirname(os.__file__), *site.getsitepackages()}
    return sorted(p for p in paths if p and os.path.isdir(p))


def _execute(cfg: dict, env: dict, timeout_s: float, cap: int) -> _Run:
    """Start the launcher and read its four outputs until it exits: stdout and stderr (capped),
    its own events (`result_fd`: the child's pid, setup errors) and the harness's data
    (`data_fd`). Only the launcher holds `result_fd`; the program holds `data_fd`."""
    ev_r, ev_w = os.pipe()
    data_r, data_w = os.pipe()
    cfg["result_fd"], cfg["data_fd"] = ev_w, data_w
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(ev_w, data_w), start_new_session=True, env=env, cwd="/",
        )
    except OSError as e:
        for fd in (ev_r, ev_w, data_r, data_w):
            os.close(fd)
        return _Run(_Capped(0), _Capped(0), None, False, False, setup_error=f"cannot start the sandbox: {e}")
    os.close(ev_w)
    os.close(data_w)
    ev_f, data_f = os.fdopen(ev_r, "rb", buffering=0), os.fdopen(data_r, "rb", buffering=0)
    payload = memoryview(json.dumps(cfg).encode())
    out, err, events, data = _Capped(cap), _Capped(cap), bytearray(), bytearray()
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, ev_r: events, data_r: data}
    files = {proc.stdout.fileno(): proc.stdout, proc.stderr.fileno(): proc.stderr, ev_r: ev_f, data_r: data_f}
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
            if started_at is None and _START in data:
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
                elif not _pump(fd, sinks[fd]):
                    sel.unregister(fd)
                    if _flooded(sinks[fd]):
                        files[fd].close()  # the writer gets EPIPE instead of blocking forever
        # The launcher is gone. With a pid namespace so is everything it started; without one a
        # leftover may still hold the pipes open, so only take what is already buffered.
        for fd, sink in sinks.items():
            if fd in sel.get_map():
                os.set_blocking(fd, False)
                for _ in range(256):
                    if not _pump(fd, sink):
                        break
    finally:
        sel.close()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        for f in (proc.stdin, *files.values()):
            if not f.closed:
                f.close()
        if pidfd is not None:
            os.close(pidfd)
    return _parse(events, data, _Run(out, err, proc.returncode, timed_out, killed_at is not None))


_START = b'{"ev": "start"}'


def _pump(fd: int, sink: _Capped | bytearray) -> bool:
    """Move what is readable on `fd` into its sink; False once the stream should be dropped
    (end of file, or a flood past its limit)."""
    try:
        chunk = os.read(fd, 65536)
    except OSError:  # BlockingIOError included: nothing more buffered
        return False
    if not chunk:
        return False
    if isinstance(sink, bytearray):
        sink += chunk
    else:
        sink.add(chunk)
    return not _flooded(sink)


def _flooded(sink: _Capped | bytearray) -> bool:
    return len(sink) > DATA_LIMIT if isinstance(sink, bytearray) else sink.seen > DRAIN_LIMIT


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


@dataclass
class _Run:
    """What one sandboxed run left: its output, exit, and the data the harness sent."""

    out: _Capped
    err: _Capped
    rc: int | None
    timed_out: bool
    killed: bool
    saw_pid: bool = False
    setup_error: str | None = None
    replies: dict = field(default_factory=dict)  # test index -> the first reply for it
    done: dict | None = None
    harness_error: str | None = None


def _json_int(digits: str) -> int:
    """JSON integers the harness may send: its values travel as 64-bit ints or hex, so a long
    run of digits is a hostile program's (int(text) is quadratic in its length)."""
    if len(digits) > 40:
        raise ValueError("integer too long")
    return int(digits)


def _lines(buf: bytearray) -> list[dict]:
    out = []
    for line in bytes(buf).splitlines():
        try:
            ev = json.loads(line, parse_int=_json_int)
        except (ValueError, RecursionError):
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out


def _parse(events: bytearray, data: bytearray, run: _Run) -> _Run:
    """Sort the launcher's events and the harness's lines into `run` (none of it is a verdict)."""
    launcher = _lines(events)
    run.saw_pid = any(ev.get("ev") == "pid" for ev in launcher)
    run.setup_error = next((str(ev.get("msg", "")) for ev in launcher if ev.get("ev") == "setup_error"), None)
    for ev in _lines(data):
        if type(ev.get("u")) is int:
            run.replies.setdefault(ev["u"], ev)  # the first reply per test counts
        elif ev.get("ev") == "done" and run.done is None:
            run.done = ev
        elif ev.get("ev") == "harness_error" and run.harness_error is None:
            run.harness_error = str(ev.get("msg", ""))
    return run


def _result(run: _Run, plan: TestPlan, verdicts: list[tuple[bool, str]], redo: list[int], t0: float) -> CodeResult:
    """The CodeResult of a judged run; `redo` are the tests judged by the sandbox's second run."""
    n = sum(ok for ok, _ in verdicts)
    untrusted = {i for i, c in enumerate(plan.checks) if plan.mode == "assert" and not c.trusted} | set(redo)
    failing = next((i for i, (ok, _) in enumerate(verdicts) if not ok), None)
    first_fail = f"test {failing + 1}: {verdicts[failing][1]}" if failing is not None else ""
    status, detail = _label(run, n == plan.total, first_fail)
    return CodeResult(n, plan.total, status, run.out.text(), run.err.text(), time.monotonic() - t0, detail[:500],
                      len(untrusted), sum(verdicts[i][0] for i in untrusted), plan.total - plan.untrusted,
                      plan.describe(failing) if failing is not None else "")


def _label(run: _Run, all_passed: bool, first_fail: str) -> tuple[str, str]:
    """(status, detail): what happened, as a label. The sandbox's "done" and "harness_error"
    lines are hints; they never make a test pass, and "ok" needs every test passed as judged."""
    if run.timed_out:
        return "timeout", "wall-clock limit"
    if not run.saw_pid:
        return "error", run.setup_error or f"sandbox did not start (exit {run.rc})" + (" (startup timeout)" if run.killed else "")
    if run.done is not None:
        status, msg = run.done.get("status"), str(run.done.get("msg", ""))
        if status == "crashed":
            return "crashed", msg
        if all_passed:
            return "ok", ""
        return ("memory" if status == "memory" else "failed"), msg or first_fail
    if run.rc is not None and run.rc - 128 == signal.SIGXCPU:
        return "timeout", "CPU-time limit"
    if run.harness_error and "MemoryError" in run.harness_error:
        return "memory", run.harness_error
    sig = run.rc - 128 if run.rc is not None and run.rc > 128 else None
    return "crashed", run.harness_error or (f"killed by signal {sig}" if sig else f"exited with code {run.rc} before reporting")
