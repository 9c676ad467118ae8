"""A small pool of long-lived checker processes with a hard per-call time limit.

Why processes: sympy (under math-verify) can spend unbounded time inside C code (big-integer
powers), where neither signals nor threads can stop it, and it is not thread-safe with
math-verify's SIGALRM timeouts. A worker that overruns is killed (SIGKILL to its session) and a
replacement is started at once, so its import cost overlaps with the next call. Only the SIGKILL
is sent on the caller's path: reaping the killed process (which may take a while to release
gigabytes) and starting the replacement happen in a background thread, so a timed-out call
returns as soon as its time is up.

Nothing starts at import: the first call starts the workers (about half a second each).

`restart()` retires a pool's processes (the next calls start fresh ones) and `restart_all()` does
it for every live pool of this process: the determinism check (`grpokit.rewards.determinism`) uses
it to score once more in fresh checker processes, so a score that depends on state kept in a
checker shows up.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

STARTUP_TIMEOUT_S = 60.0


class WorkerError(RuntimeError):
    """The checker process could not be started or died on its own (not a timeout)."""


class _Worker:
    def __init__(self, script: str):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        self.proc = subprocess.Popen(
            [sys.executable, "-I", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True, env=env, cwd="/",
        )
        self.buf = b""
        self.ready = False
        self.next_id = 0

    def _readline(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise WorkerError("checker process exited")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def call(self, req: dict, timeout_s: float) -> dict | None:
        """The reply, or None when the request timed out or killed the worker (the caller then
        replaces it). Raises WorkerError only when the worker cannot start: a hostile input that
        crashes the checker must count as a wrong answer, not as "cannot be scored"."""
        if not self.ready:
            try:
                line = self._readline(time.monotonic() + STARTUP_TIMEOUT_S)
            except WorkerError:
                line = None
            if line != b"ready":
                raise WorkerError("checker process did not start (is math-verify installed?)")
            self.ready = True
        self.next_id += 1
        req = dict(req, id=self.next_id)
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._readline(deadline)
            except WorkerError:  # died while working on this request
                return None
            if line is None:
                return None
            try:
                rep = json.loads(line)
            except ValueError:
                continue
            if rep.get("id") == self.next_id:
                return rep

    def signal_kill(self) -> None:
        """SIGKILL to the worker's session; does not wait (one system call)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def kill(self) -> None:
        self.signal_kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.proc.wait()


class WorkerPool:
    """At most `size` workers; `call` blocks until one is free (every holder has a deadline)."""

    def __init__(self, script: str, size: int):
        self.script, self.size = script, max(1, size)
        self._reset()
        atexit.register(self.close)
        _POOLS.add(self)

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.idle: list[_Worker] = []
        self.count = 0
        self.closed = False
        self.generation = 0             # bumped by restart(): older workers are retired
        self.cv = threading.Condition()

    def _acquire(self) -> _Worker:
        if os.getpid() != self.pid:  # forked: the parent's workers are not ours
            self._reset()
        with self.cv:
            while not self.idle and self.count >= self.size and not self.closed:
                self.cv.wait()
            if self.closed:
                raise WorkerError("the checker pool is closed (the interpreter is shutting down)")
            if self.idle:
                return self.idle.pop()
            self.count += 1
            gen = self.generation
        try:
            w = _Worker(self.script)
            w.generation = gen
            return w
        except Exception as e:  # noqa: BLE001 - whatever failed, the slot must be given back
            with self.cv:
                self.count -= 1
                self.cv.notify()
            raise WorkerError(f"cannot start checker process: {e}") from None

    def _release(self, w: _Worker, healthy: bool) -> None:
        if healthy:
            with self.cv:
                keep = not self.closed and getattr(w, "generation", 0) == self.generation
                if keep:
                    self.idle.append(w)
                else:
                    self.count -= 1
                self.cv.notify()
            if not keep:                # came back after close() or restart(): retired
                w.kill()
            return
        # Off the caller's path: the caller only sends SIGKILL and returns at once; the slot stays
        # taken until the replacement is in `idle` (so at most `size` checkers ever work at once).
        w.signal_kill()
        try:
            threading.Thread(target=self._replace, args=(w,), name="checker-respawn", daemon=True).start()
        except RuntimeError:  # no thread to be had: replace it here rather than lose the slot
            self._replace(w)

    def _replace(self, dead: _Worker) -> None:
        gen = self.generation
        try:
            new = _Worker(self.script)  # starts importing right away, while the old one is reaped
        except Exception:  # noqa: BLE001 - the slot must be given back whatever happened
            new = None
        with self.cv:
            unwanted = new is not None and (self.closed or gen != self.generation)
            if new is not None:
                new.generation = gen
            if new is None or unwanted:
                self.count -= 1
            else:
                self.idle.append(new)
            self.cv.notify()
        if unwanted:
            new.kill()
        dead.kill()  # closes its pipes and reaps it (no zombie)

    def call(self, req: dict, timeout_s: float) -> dict | None:
        """Reply dict, or None on timeout. Raises WorkerError when no worker can answer."""
        w = self._acquire()
        healthy = False
        try:
            rep = w.call(req, timeout_s)
            healthy = rep is not None
            return rep
        finally:
            self._release(w, healthy)

    def close(self) -> None:
        if os.getpid() != self.pid:
            return
        with self.cv:
            idle, self.idle = self.idle, []
            self.count -= len(idle)
            self.closed = True
            self.cv.notify_all()        # callers waiting for a slot get WorkerError, not a hang
        for w in idle:
            w.kill()

    def restart(self) -> int:
        """Retire every checker process: the idle ones are killed (and reaped) now, a busy one
        when its call returns; later calls start fresh processes. Returns how many processes the
        pool had (idle or busy). A closed pool stays closed (returns 0)."""
        if os.getpid() != self.pid:  # forked: the parent's workers are not ours
            self._reset()
            return 0
        with self.cv:
            if self.closed:
                return 0
            live = self.count
            idle, self.idle = self.idle, []
            self.count -= len(idle)
            self.generation += 1
            self.cv.notify_all()        # freed slots: waiting callers start fresh workers
        for w in idle:
            w.kill()
        return live

    def pids(self) -> list[int]:
        """Process ids of the idle checker processes (those between calls)."""
        with self.cv:
            return [w.proc.pid for w in self.idle]


_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def restart_all() -> int:
    """`restart()` every open pool of this process; returns how many checker processes were
    retired (0: no pool had started one)."""
    return sum(pool.restart() for pool in list(_POOLS))
