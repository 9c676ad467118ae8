"""`make bench-scale`: the benchmark's large model trained by one process with 2 threads and by 2
processes with 1 thread each (torchrun, FSDP2, gloo), on the same global batch.

    .venv/bin/python bench/scale.py [--steps 6] [--max-new-tokens 32] [--work runs/bench-scale]

Reported per configuration: mean step time after one warm-up step, tokens per second, each rank's
peak resident memory (VmHWM, polled while it runs) and the bytes a rank holds for parameters,
gradients and AdamW state (`memory/train_state_mb`, measured on the shards; for the single process,
4 bytes x parameters x (1 + 1 + 2)). Results go to bench/results/scale-<date>-<host>.json and are
printed as a markdown table (docs/distributed.md quotes it). Figures from a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from run import prepare  # noqa: E402


def _vmhwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _ranks(root_pid: int) -> list[int]:
    """The training processes under `root_pid` (itself when it trains; torchrun's workers otherwise)."""
    import psutil

    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    out = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "grpokit" in cmd and "torch.distributed.run" not in cmd:
            out.append(p.pid)
    return out


def run_one(argv: list[str], env: dict, log: Path) -> dict[int, float]:
    """Run a training command; returns the peak RSS (MiB) of each training process."""
    peaks: dict[int, float] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                for pid in _ranks(proc.pid):
                    v = _vmhwm_mb(pid)
                    if v is not None:
                        peaks[pid] = max(peaks.get(pid, 0.0), v)
                time.sleep(0.25)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:6])} ... failed (exit {proc.returncode}); see {log}")
    return peaks


def summarise(run_dir: Path, peaks: dict[int, float], params: int, world: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 2]                 # step 1 is the warm-up
    step = statistics.mean(r["time/step"] for r in rows)
    state = (statistics.mean(r["memory/train_state_mb"] for r in rows) if "memory/train_state_mb" in rows[0]
             else params * 4 * 4 / 2**20)
    return {"world": world, "step_s": step, "step_s_each": [r["time/step"] for r in rows],
            "tokens_per_s": statistics.mean(r["throughput/tokens_per_s"] for r in rows),
            "peak_rss_mb_per_rank": sorted(peaks.values()), "train_state_mb_per_rank": state,
            "train_state_measured": "memory/train_state_mb" in rows[0], "mean_completion_length": statistics.mean(r["completion/length_mean"] for r in rows)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="training steps per configuration (the first is a warm-up)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--size", default="large", choices=sorted(common.SIZES))
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-scale"))
    ap.add_argument("--out", default="", help="results JSON (default: bench/results/scale-DATE-HOST.json)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    dims, _ = prepare(work, [args.size])
    params = dims[args.size + "_params"]
    over = [f"model.path={work / f'model-{args.size}'}", f"data.path={work / 'prompts.jsonl'}",
            f"rollout.group_size={common.GROUP_SIZE}", f"rollout.batch_size={common.GROUP_SIZE * common.PROMPTS_PER_STEP}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={common.TEMPERATURE}",
            f"optim.lr={common.LR}", "optim.micro_batch_size=16", f"train.steps={args.steps}", "train.save_every=0",
            "train.save_every_minutes=0", "train.progress=false", "train.check_rewards=false",
            "train.batch_advice=false", "train.sample_every=0", "monitor.sinks=[jsonl]", "rewards=[{name: exact_match}]", "data.eval_split=0",
            f"train.seed={common.SEED}"]
    base_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = []
    for world, threads in ((1, 2), (2, 1)):
        run_dir = work / f"run-{world}x{threads}"
        cmd = [sys.executable, "-m", "grpokit", "train", *over, f"train.run_dir={run_dir}"]
        if world > 1:
            from grpokit.train.launch import torchrun_command
            cmd = torchrun_command(world, ["train", *over, f"train.run_dir={run_dir}", "train.distributed=fsdp2"])
        print(f"{world} process(es) x {threads} thread(s) ...", flush=True)
        peaks = run_one(cmd, {**base_env, "OMP_NUM_THREADS": str(threads)}, work / f"run-{world}x{threads}.log")
        results.append({"threads": threads, **summarise(run_dir, peaks, params, world)})
    a, b = results
    table = ["| processes x threads | step (s) | tokens/s | peak RSS per rank (MiB) | params+grads+Adam per rank (MiB) |",
             "|---|---|---|---|---|"]
    for r in results:
        table.append(f"| {r['world']} x {r['threads']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{', '.join(f'{v:.0f}' for v in r['peak_rss_mb_per_rank'])} | "
                     f"{r['train_state_mb_per_rank']:.1f}{'' if r['train_state_measured'] else ' (counted)'} |")
    table.append(f"| ratio 2x1 / 1x2 | {b['step_s'] / a['step_s']:.2f} | {b['tokens_per_s'] / a['tokens_per_s']:.2f} | "
                 f"{max(b['peak_rss_mb_per_rank']) / max(a['peak_rss_mb_per_rank']):.2f} | "
                 f"{b['train_state_mb_per_rank'] / a['train_state_mb_per_rank']:.2f} |")
    text = "\n".join(table)
    print(text)
    out = Path(args.out) if args.out else HERE / "results" / f"scale-{dt.datetime.now(dt.timezone.utc):%Y%m%d}-{socket.gethostname()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"size": args.size, "params": params, "max_new_tokens": args.max_new_tokens,
                               "steps": args.steps, "results": results, "table": text}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
