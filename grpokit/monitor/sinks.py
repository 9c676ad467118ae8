"""Metric sinks: RUN_DIR/metrics.jsonl always, TensorBoard when it is installed."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


class MetricSink:
    """Appends one JSON row per step to RUN_DIR/metrics.jsonl (and scalars to RUN_DIR/tb when
    TensorBoard is installed). Nothing is written to disk before the first `write`, so a run
    directory holds no output of a run that has not logged a step yet."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = tensorboard
        self.tb = None                 # the SummaryWriter, opened at the first write

    def _tb_writer(self):
        if self.tb is None and self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.tensorboard = False
        return self.tb

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows written after the checkpoint's step (they will be redone)."""
        truncate_jsonl(self.path, step)

    def write(self, step: int, metrics: dict) -> None:
        """Append `{"step": step, "time": unix seconds, **metrics}`."""
        row = {"step": step, "time": time.time(),
               **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        tb = self._tb_writer()
        if tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file and rename it over `path`: a process killed meanwhile leaves the
    old file or the new one, never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the rows of a JSONL log whose `step` is after `step` (on resume), atomically. Rows that
    do not parse are dropped too (a line cut by a kill)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                keep.append(line + "\n")
        except (ValueError, TypeError, AttributeError):
            continue
    atomic_write_text(path, "".join(keep))
