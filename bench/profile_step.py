"""Profile one grpokit GRPO step of the benchmark's workload under `torch.profiler`.

    .venv/bin/python bench/profile_step.py --model runs/bench/model-smollm2 \
        --data runs/bench/prompts-smollm2.jsonl --max-new-tokens 64 --micro-batch 8 [--fixed-length]
        [--prompts 8]      (BENCH_THREADS=1: one thread, for a loaded machine)

Runs one warm-up step (one-time costs: the matmul library choice, the optimizer's state), then
one step under the profiler. Prints the phase split the trainer reports (`time/rollout`,
`time/logprobs`, `time/update`, ...) and the operations with the most self CPU time, and writes
both as JSON (`--out`). Same trainer and settings as the benchmark's grpokit side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import side_grpokit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    side_grpokit.workload_args(ap, "runs/bench/profile")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=common.PROMPTS_PER_STEP, help="prompts per step (G stays 8)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.steps = 2
    args.agent = False
    common.PROMPTS_PER_STEP = args.prompts

    import torch
    from torch.profiler import ProfilerActivity, profile

    trainer = side_grpokit.build(args)
    t = time.perf_counter()
    trainer.step()
    trainer.step_idx += 1
    warm_s = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        m = trainer.step()
        step_s = time.perf_counter() - t
    phases = {k: round(float(v), 3) for k, v in m.items() if k.startswith("time/")}
    top, total_s = common.top_ops(prof, args.top)
    out = {"warmup_step_s": round(warm_s, 2), "profiled_step_s": round(step_s, 2), "phases": phases,
           "self_cpu_total_s": round(total_s, 2), "top_ops": top, "threads": torch.get_num_threads(),
           "completion_tokens": int(trainer.last_batch.lengths.sum()), "load_average": os.getloadavg()}
    print(f"warm-up step {warm_s:.1f} s; profiled step {step_s:.1f} s; threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("phases: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    common.print_top_ops(top)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
