"""The update's useful FLOPs against the machine's matmul peak, on one real step's batch.

    .venv/bin/python bench/update_check.py --model runs/bench/model-smollm2 \
        --data runs/bench/prompts-smollm2.jsonl --max-new-tokens 64 --micro-batch 8 [--fixed-length]
        [--rounds 3] [--profile 25]

Builds the benchmark's grpokit side (bench/side_grpokit.py), runs one step for a real batch (and
the one-time costs), then times, in alternation, the reference's log-probs and the policy's update
(`train_step`: forward, backward and the optimizer over every micro-batch) on that same batch.
Useful FLOPs are counted as the benchmark counts them (`common.step_flops`: each prompt once per
group, no padding): the update is the policy's forward + backward, 3x a forward. The peak is the
best of the BLAS and oneDNN n x n x n GEMMs measured in this process (`run.matmul_peak`).
`--compare-head`: rounds alternate between the LM head's native kernels and PyTorch's path;
`--compare-plan`: between micro-batches cut by tokens (the planner) and by rows.
`--compare-micro-batch-cost C`: between the planner as it is and with its MICRO_BATCH_COST at C.
`--profile N`: one more update under `torch.profiler`, its N operations with the most self time.
`--at-step N`: N training steps first, then the measurement on step N's batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import run as bench_run  # noqa: E402
import side_grpokit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side_grpokit.workload_args(ap, "runs/bench/update-check")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="profile one more update; show this many operations")
    ap.add_argument("--compare-head", action="store_true",
                    help="alternate rounds with the LM head's native kernels on and off (grpokit.train.head)")
    ap.add_argument("--compare-plan", action="store_true",
                    help="alternate rounds with micro-batches cut by tokens (the planner) and by rows "
                         "(a prompt's rows together, --micro-batch rows each: the planner before 2026-12-06)")
    ap.add_argument("--compare-micro-batch-cost", type=float, default=None, metavar="C",
                    help="alternate rounds with the planner's MICRO_BATCH_COST as it is and at C "
                         "(grpokit.train.logprobs: what one more micro-batch is worth in tokens)")
    ap.add_argument("--at-step", type=int, default=0,
                    help="train this many steps first and measure on the next step's batch (the bench's "
                         "timed steps are steps 1-3: with EOS their completions are shorter than step 0's)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.steps, args.agent = args.at_step + 2, False

    import torch

    from grpokit.train import head, logprobs
    from grpokit.train import worker as worker_mod

    trainer = side_grpokit.build(args)
    for _ in range(args.at_step + 1):
        trainer.step()
        trainer.step_idx += 1
    batch, worker = trainer.last_batch, trainer.worker
    beta = trainer.step_fn.kl_ctl.beta
    dims, _ = bench_run.real_dims(Path(args.model))
    fl = common.step_flops(dims, [len(p) for p in batch.prompt_ids], batch.lengths.tolist(), common.GROUP_SIZE)
    peak = bench_run.matmul_peak()

    mb_cost = logprobs.MICRO_BATCH_COST
    sides = (["native", "pytorch"] if args.compare_head else ["by tokens", "by rows"] if args.compare_plan
             else ["as is", f"micro-batch cost {args.compare_micro_batch_cost:g}"]
             if args.compare_micro_batch_cost is not None else ["as is"])
    plan_by_tokens = logprobs.plan_micro_batches

    def plan_by_rows(total_lengths, size, prompts=None):      # a prompt's rows together, `size` rows each
        if prompts is None:
            return plan_by_tokens(total_lengths, size)
        first = {}
        for i, p in enumerate(prompts):
            first.setdefault(tuple(p), i)
        order = sorted(range(len(prompts)), key=lambda i: (first[tuple(prompts[i])], total_lengths[i]))
        return [order[i:i + size] for i in range(0, len(order), size)]
    t_ref = {k: [] for k in sides}
    t_upd = {k: [] for k in sides}
    saved = head._state.get("fns", head.kernels())
    for k in range(args.rounds):
        for side in sides:                     # in alternation, so drift falls on both
            head._state["fns"] = None if side == "pytorch" else saved
            worker_mod.plan_micro_batches = plan_by_rows if side == "by rows" else plan_by_tokens
            logprobs.MICRO_BATCH_COST = args.compare_micro_batch_cost if side.startswith("micro-batch cost") else mb_cost
            t = time.perf_counter()
            worker.logprobs(batch, "reference", dropout=False)   # (dropout=False: past the cache)
            t_ref[side].append(time.perf_counter() - t)
            t = time.perf_counter()
            st = worker.train_step(batch, beta, step=100 + k)
            t_upd[side].append(time.perf_counter() - t)
    head._state["fns"] = saved
    worker_mod.plan_micro_batches = plan_by_tokens
    logprobs.MICRO_BATCH_COST = mb_cost
    peaks = [peak, bench_run.matmul_peak()]    # the machine's peak drifts: the best of two, before and after
    top = max(peaks, key=lambda p: p["peak"])["peak"]
    out = {
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(), "peaks": peaks, "peak": top,
        "completion_tokens": int(batch.lengths.sum()), "rows": len(batch),
        "padding_frac": st.get("update/padding_frac"), "policy_flops": fl["policy"], "reference_flops": fl["reference"],
        "sides": {side: {"reference_s": t_ref[side], "update_s": t_upd[side],
                         "reference_frac_of_peak": fl["reference"] / min(t_ref[side]) / top,
                         "update_frac_of_peak": fl["policy"] / min(t_upd[side]) / top,
                         "update_gflop_per_s": fl["policy"] / min(t_upd[side]) / 1e9} for side in sides},
    }
    print(f"peak {top / 1e9:.0f} GFLOP/s (best of " + ", ".join(f"{p['peak'] / 1e9:.0f}" for p in peaks)
          + f"); {out['rows']} rows, {out['completion_tokens']} completion tokens, padding "
          f"{out['padding_frac']:.2f}; load {os.getloadavg()[0]:.1f}")
    for side, r in out["sides"].items():
        print(f"[{side}] reference log-probs: best {min(r['reference_s']):.2f} s (median "
              f"{statistics.median(r['reference_s']):.2f}), {100 * r['reference_frac_of_peak']:.0f}% of peak; "
              f"update: best {min(r['update_s']):.2f} s (median {statistics.median(r['update_s']):.2f}), "
              f"{r['update_gflop_per_s']:.0f} GFLOP/s, {100 * r['update_frac_of_peak']:.0f}% of peak")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            worker.train_step(batch, beta, step=999)
        out["top_ops"], _ = common.top_ops(prof, args.profile)
        common.print_top_ops(out["top_ops"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
