"""Config section `monitor`: where metrics go (grpokit.monitor.sinks)."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from grpokit._names import closest
from grpokit.config.base import _Section
from grpokit.monitor.sinks import SINK_NAMES


class MonitorConfig(_Section):
    sinks: list[str] | None = None
    """Where metrics go: `jsonl` (RUN_DIR/metrics.jsonl, always on), `tensorboard` (RUN_DIR/tb),
    `wandb`, `mlflow` (docs/metrics.md); a list or a comma-separated string. Unset: jsonl, plus
    TensorBoard when it is installed. A listed sink whose package is missing stops the run at start
    with one line naming the pip extra."""
    project: str = ""
    """W&B project and MLflow experiment; empty: WANDB_PROJECT for W&B when set, else `grpokit`."""
    run_name: str = ""
    """Run name in W&B and MLflow; empty: the run directory's folder name (`runs/grpo` -> `grpo`)."""
    wandb_mode: Literal["offline", "online", "disabled"] | None = None
    """W&B mode; unset: WANDB_MODE when set, else `offline` (files under RUN_DIR/wandb, uploaded
    later by `wandb sync`; no network needed)."""

    @field_validator("sinks", mode="before")
    @classmethod
    def _sink_names(cls, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = [v for v in (x.strip() for x in value.split(",")) if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of sink names ({', '.join(SINK_NAMES)})")
        for name in value:
            if name not in SINK_NAMES:
                close = closest(name, SINK_NAMES)
                hint = f" (did you mean '{close}'?)" if close else ""
                raise ValueError(f"unknown sink '{name}'{hint}; valid sinks: {', '.join(SINK_NAMES)}")
        return ["jsonl"] + [n for i, n in enumerate(value) if n != "jsonl" and n not in value[:i]]
