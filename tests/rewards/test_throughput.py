"""Throughput of the code sandbox: tiny passing programs per second through the batch API.

Run: .venv/bin/pytest -q -m slow tests/rewards/test_throughput.py -s
"""

from __future__ import annotations

import time

import pytest

from grpokit.rewards import run_tests_batch
from grpokit.rewards._sandbox import isolation
from grpokit.rewards.code import default_parallelism


@pytest.mark.slow
def test_run_tests_throughput():
    n = 40
    programs = [f"def f(x):\n    return x + {i}\n" for i in range(n)]  # distinct: no de-duplication
    tests = [f"assert f(1) == {i + 1}\nassert f(0) == {i}\n" for i in range(n)]
    run_tests_batch(programs[:2], tests[:2], timeout_s=5.0)  # probe + warm caches
    t0 = time.monotonic()
    res = run_tests_batch(programs, tests, timeout_s=5.0)
    dt = time.monotonic() - t0
    assert [r.status for r in res] == ["ok"] * n
    rate = n / dt
    print(f"\nrun_tests throughput: {rate:.1f} programs/s ({n} programs, {dt:.2f} s, "
          f"{default_parallelism()} workers, isolation={isolation().mode})")
    assert rate > 2.0
