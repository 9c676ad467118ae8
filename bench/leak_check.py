"""Resident memory and live tensors over training steps of a saved model (a leak check).

    .venv/bin/python bench/leak_check.py --model runs/bench/model-smollm2 \
        --data runs/bench/prompts-smollm2.jsonl [--steps 10] [--prompts 2] [--group 4] [--tokens 16]

Prints, after each step, the resident size once freed heap pages are returned to the system
(`malloc_trim`) and, at steps 2, steps / 2 and the last, the number and bytes of live tensors. The
optimizer's state appears in step 1; from step 2 on neither figure should grow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.train.test_leak import live_tensors, rss_mb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--run-dir", default="runs/bench/leak")
    args = ap.parse_args()
    import torch
    from grpokit.config import config_from_dict
    from grpokit.train import build_run

    n = args.prompts * args.group
    cfg = config_from_dict({
        "model": {"path": args.model, "dtype": "float32", "device": "cpu"},
        "data": {"path": args.data, "eval_split": 0},           # no held-out evaluation inside the timed steps
        "rollout": {"group_size": args.group, "batch_size": n, "temperature": 0.8,
                    "max_new_tokens": args.tokens, "ignore_eos": True},
        "algorithm": {"kl": {"beta": 0.02, "estimator": "k3", "controller": "fixed"}},
        "rewards": [{"name": "boxed_format"}],
        "optim": {"lr": 1e-6, "micro_batch_size": n},
        "train": {"steps": args.steps, "seed": 0, "run_dir": args.run_dir, "save_every": 0,
                  "sample_every": 0, "progress": False},
        "monitor": {"sinks": ["jsonl"]},
    })
    torch.manual_seed(0)
    trainer = build_run(cfg, health=True)
    rows = []
    for i in range(1, args.steps + 1):
        trainer.step()
        trainer.step_idx += 1
        row = {"step": i, "rss_mb": round(rss_mb(), 1)}
        if i in (2, args.steps // 2, args.steps):
            row["tensors"], row["tensor_bytes"] = live_tensors()
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
