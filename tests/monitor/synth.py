"""Synthetic training histories and run directories for the monitor tests.

``healthy_history`` is what a run that learns looks like: KL to the reference saturating well
below the trend floor, lengths drifting slowly, a third of the groups without signal, reward and
held-out pass@1 rising together, entropy decaying gently, each with a few percent of noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ALL_METRICS = (
    "loss/policy", "loss/kl", "loss/total", "loss/token_mean", "kl/ref", "kl/beta",
    "reward/mean", "reward/std", "reward/correct/mean", "reward/correct/errors",
    "reward/format/mean", "reward/format/errors", "reward/checker_disagreement",
    "completion/length_mean", "completion/length_max", "completion/clipped_ratio",
    "advantage/mean", "advantage/std", "group/frac_zero_std", "policy/entropy",
    "policy/clip_frac_low", "policy/clip_frac_high", "policy/approx_kl_old", "policy/ratio_max",
    "optim/grad_norm", "optim/lr", "throughput/tokens_per_s", "time/rollout", "time/reward",
    "time/logprobs", "time/update", "time/step", "memory/rss_mb", "guard/skipped_steps",
    "guard/rollbacks", "ref/integrity_drift",
)  # 36 per-step metrics; eval/pass@1 and eval/mean@k come every eval_every steps


def healthy_history(n: int = 200, seed: int = 0, eval_every: int = 20) -> list[dict]:
    rng = np.random.default_rng(seed)

    def noisy(v: float, rel: float = 0.05) -> float:
        return float(v * (1 + rel * rng.standard_normal()))

    rows = []
    for t in range(1, n + 1):
        learn = 1 - math.exp(-t / 80)
        row = {"step": t, "time": 1_700_000_000 + 3.0 * t}
        for k in ALL_METRICS:
            row[k] = noisy(1.0, 0.1)  # generic positive noise for metrics no rule reads
        row.update({
            "kl/ref": noisy(0.03 * (1 - math.exp(-t / 40)) + 1e-4, 0.15),
            "reward/mean": float(np.clip(0.2 + 0.4 * learn + 0.05 * rng.standard_normal(), 0, 1)),
            "reward/checker_disagreement": abs(0.02 + 0.01 * rng.standard_normal()),
            "completion/length_mean": noisy(120 + 0.2 * t, 0.08),
            "completion/clipped_ratio": abs(0.01 * rng.standard_normal()),
            "advantage/std": noisy(0.85, 0.06),
            "group/frac_zero_std": float(np.clip(0.3 + 0.1 * rng.standard_normal(), 0, 1)),
            "policy/entropy": noisy(0.5 + 0.4 * math.exp(-t / 100), 0.08),
            "ref/integrity_drift": abs(2e-5 * rng.standard_normal()),
            "guard/skipped_steps": 0.0,
            "optim/lr": 1e-6,
        })
        if t % eval_every == 0:
            row["eval/pass@1"] = float(np.clip(0.15 + 0.35 * learn + 0.02 * rng.standard_normal(), 0, 1))
            row["eval/mean@k"] = row["eval/pass@1"] * 0.9
        rows.append(row)
    return rows


def series(key: str, values, start: int = 1) -> list[dict]:
    """A history that logs only ``key``."""
    return [{"step": start + i, key: float(v)} for i, v in enumerate(values)]


def write_run_dir(path: Path, history: list[dict], *, alarms: list[dict] | None = None,
                  sample_every: int = 10, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")  # NaN / inf written as NaN / Infinity, like the trainer
    if config is not None:
        import yaml

        (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if alarms is not None:
        with open(path / "alarms.jsonl", "w") as f:
            for a in alarms:
                f.write(json.dumps(a) + "\n")
    if sample_every:
        (path / "samples").mkdir(exist_ok=True)
        for step in range(sample_every, len(history) + 1, sample_every):
            with open(path / "samples" / f"step_{step:06d}.jsonl", "w") as f:
                for i in range(6):
                    ok = i % 2 == 0
                    f.write(json.dumps({
                        "step": step,
                        "prompt": f"<script>alert('step {step}')</script> What is {i} + {i}?",
                        "completion": f"a < b && c > d; answer: {2 * i if ok else 7}",
                        **({"answer": str(2 * i)} if i != 5 else {}),
                        "reward": 1.0 if ok else 0.0,
                        "rewards": {"correct": 1.0 if ok else 0.0, "format": None if i == 1 else 0.5},
                        "advantage": 0.9 if ok else -0.9,
                        "length": 12 + i,
                        "finish_reason": "length" if i == 1 else "eos",
                    }) + "\n")
    return path
