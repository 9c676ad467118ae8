"""A rich progress bar with ETA and the key training signals."""

from __future__ import annotations

import math

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

KEYS = (("reward/mean", "reward"), ("kl/ref", "kl"), ("completion/length_mean", "len"),
        ("policy/entropy", "ent"), ("eval/pass@1", "pass@1"))


class StepProgress:
    def __init__(self, total: int, start: int = 0):
        self.progress = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"))
        self.task = self.progress.add_task("", total=total, completed=start)
        self.seen: dict[str, float] = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, step: int, metrics: dict) -> None:
        self.seen.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        parts = [f"{short} {self.seen[k]:.3g}" for k, short in KEYS
                 if k in self.seen and math.isfinite(self.seen[k])]
        self.progress.update(self.task, completed=step, description="  ".join(parts))
