"""Metric sinks: RUN_DIR/metrics.jsonl always, TensorBoard when it is installed."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricSink:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.tb = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows written after the checkpoint's step (they will be redone)."""
        if not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue
        self.path.write_text("".join(k + "\n" for k in keep))

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


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
