"""Time bounds for the reward tests that hold on a busy machine.

Two kinds of bound, two clocks:

- **Cheap for the trainer**: work the trainer does in its own thread (planning tests, judging the
  values a sandbox sent, reading its output, extracting answers and code) must cost it little. That
  is measured in CPU seconds of the calling thread (`thread_cpu`), which other processes on the
  machine do not stretch the way they stretch wall time. The bounds keep a wide margin over the
  measured cost (the costliest judged value takes about 0.6 s of CPU, every other case under
  0.1 s) and stay far below the failures they guard against (seconds to hours of CPU).
- **A real deadline**: a sandboxed program, a checker process or a reward cut off at its time
  limit. That is wall time, bounded by `under_load(quiet_s)`: the bound that holds on a quiet
  machine times `LOAD_FACTOR`, so that start-up and scheduling on a loaded machine (other test
  runs, two busy loops beside the suite) still fit. The failures these tests look for (a program
  never killed, a caller waiting for a kill or a respawn) take minutes or never end.
"""

from __future__ import annotations

import time

LOAD_FACTOR = 4.0


def under_load(quiet_s: float) -> float:
    """Wall-clock bound for a deadline test: `quiet_s` (enough on a quiet machine) times LOAD_FACTOR."""
    return LOAD_FACTOR * quiet_s


def thread_cpu() -> float:
    """CPU seconds of the calling thread (the trainer's own cost of the work between two reads)."""
    return time.thread_time()
