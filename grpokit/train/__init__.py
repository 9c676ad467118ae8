"""Training: the run's builder, its clock, one step, the workers, checkpoints. `build_run(cfg)` turns
a config into a ready `Trainer` (config is read there, at the edge; inner code receives built
objects). docs/training.md, "Architecture"."""

from __future__ import annotations

from grpokit.train.builder import build_eval, build_health, build_rewards, build_run, load_datasets

build_trainer = build_run
"""The builder's earlier name (kept for scripts written against it)."""

__all__ = ["build_eval", "build_health", "build_rewards", "build_run", "build_trainer", "load_datasets"]
