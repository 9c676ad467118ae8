"""Launching torchrun jobs from tests: bounded in time, on a free port, and never leaving a process
behind (the job runs in its own process group, killed in `finally` whatever happened)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpokit.train.distributed import free_port

REPO = Path(__file__).resolve().parents[2]


def job_env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun_argv(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]


def start(nproc: int, args: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen(torchrun_argv(nproc, args), cwd=REPO, env=job_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the job's whole process group (torchrun and its ranks); nothing when gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run(nproc: int, args: list[str], *, timeout: float, check: bool = True, **env) -> tuple[int, str, float]:
    """(exit status, output, seconds) of a torchrun job; fails the test past `timeout` seconds."""
    t0 = time.monotonic()
    proc = start(nproc, args, **env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out = proc.stdout.read() if proc.stdout else ""
        pytest.fail(f"torchrun job did not finish in {timeout:.0f} s:\n{out[-4000:]}")
    finally:
        kill_group(proc)
    seconds = time.monotonic() - t0
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun job failed (exit {proc.returncode}):\n{out[-6000:]}")
    return proc.returncode, out, seconds


def program(name: str, out: Path, *args) -> list[str]:
    """torchrun arguments running tests/train/dist_programs.py NAME OUT ARGS."""
    return [str(REPO / "tests" / "train" / "dist_programs.py"), name, str(out), *map(str, args)]


def run_nodes(nnodes: int, args: list[str], *, timeout: float) -> list[str]:
    """A job of `nnodes` "machines" on this one: as many torchrun launchers, one process each, meeting
    at a c10d rendezvous on a free local port (what `torchrun --nnodes N --rdzv-backend c10d` does
    across machines). Returns each launcher's output; fails the test when one fails or runs past
    `timeout` seconds. Every launcher and its rank are killed at the end, whatever happened."""
    port, procs = free_port(), []
    rdzv = ["--nnodes", str(nnodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"grpokit-test-{port}"]
    try:
        for _ in range(nnodes):
            procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *rdzv, *args], cwd=REPO,
                                          env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        deadline, outs = time.monotonic() + timeout, []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a launcher of the {nnodes}-node job did not finish in {timeout:.0f} s")
            if proc.returncode != 0:
                pytest.fail(f"a launcher of the {nnodes}-node job failed (exit {proc.returncode}):\n{out[-6000:]}")
            outs.append(out)
        return outs
    finally:
        for proc in procs:
            kill_group(proc)
