"""The grpokit side of the benchmark (runs in the project's .venv). Driven by bench/run.py."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def settings(args) -> dict:
    """grpokit's best settings for this workload (what the table's footnote reports)."""
    return {
        "micro_batch_size": args.micro_batch,
        "gradient_checkpointing": False,
        "threads": common.cores(),
        "ref_check_every": 0,
    }


def build(args):
    import torch

    torch.set_num_threads(common.cores())
    from grpokit.config import config_from_dict
    from grpokit.rewards import register
    from grpokit.train import build_trainer

    register("bench_partial_credit")(common.partial_credit)
    n = common.PROMPTS_PER_STEP * common.GROUP_SIZE
    cfg = config_from_dict({
        "model": {"path": args.model, "dtype": "float32", "device": "cpu", "gradient_checkpointing": False},
        "data": {"path": args.data},
        "rollout": {"group_size": common.GROUP_SIZE, "batch_size": n, "temperature": common.TEMPERATURE,
                    "max_new_tokens": args.max_new_tokens, "ignore_eos": args.fixed_length},
        "algorithm": {"advantage": "grpo", "loss_agg": "token_mean", "mu": 1, "mini_batches": 1,
                      "eps_low": common.EPSILON, "eps_high": common.EPSILON,
                      "kl": {"beta": common.BETA, "estimator": "k3", "controller": "fixed"}},
        "rewards": [{"name": "bench_partial_credit"}],
        "optim": {"lr": common.LR, "max_grad_norm": common.MAX_GRAD_NORM, "micro_batch_size": args.micro_batch},
        "train": {"steps": args.steps, "seed": common.SEED, "run_dir": args.run_dir,
                  "save_every": 0, "sample_every": 0, "progress": False},
        "monitor": {"sinks": ["jsonl"]},
        # the reference-integrity probe is extra work TRL does not do: off for a like-for-like step
        "guard": {"ref_check_every": 0},
    })
    return build_trainer(cfg, health=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--fixed-length", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=common.WARMUP_STEPS + common.STEPS)
    args = ap.parse_args()
    t0 = time.perf_counter()
    trainer = build(args)
    setup_s = time.perf_counter() - t0

    def step() -> dict:
        t, c = time.perf_counter(), time.process_time()
        m = trainer.step()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        trainer.step_idx += 1
        batch = trainer.last_batch
        return {
            "step_s": wall, "cpu_s": cpu,
            "generation_s": m["time/rollout"],
            "reward_s": m["time/reward"],
            "reference_s": m["time/logprobs"],
            "update_s": m["time/update"],
            "grad_norm": m["optim/grad_norm"],
            "reward_std": m["reward/std"],
            "prompt_lens": [len(p) for p in batch.prompt_ids],
            "completion_lens": batch.lengths.tolist(),
            "rss_mb": common.peak_rss_mb(),
        }

    import torch
    common.serve(step, {"setup_s": setup_s, "settings": settings(args), "torch": torch.__version__,
                        "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
