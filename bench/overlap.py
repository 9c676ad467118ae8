"""On-policy vs one-step-off-policy (`rollout.async`) step time on the demo task, in one run.

    .venv/bin/python bench/overlap.py [--steps 20] [--threads 1] [--nproc 1] [--docs]

Builds (or reuses) the demo's warm-started model under --work, starts one `grpokit rollout-server`
(HF backend) in a child process, then trains the demo configuration with `rollout.engine: server`
twice from the same weights: on-policy, then with `rollout.async: true`. Each mode runs one warm-up
step and then --steps steps; the figure is the wall time between consecutive steps (what a run's
length is made of), median and mean, and the ratio on-policy / async. The trainer and the server
each get --threads torch threads (on a 2-core machine, one core each). Nothing is downloaded.
`--docs` writes the table into docs/rollout.md.

`--nproc N`: the trainer is a torchrun job of N ranks (FSDP2, one thread each) instead, every rank
sending its own groups to the one server; the figure is then each step's `time/step` from the
run's metrics (the slowest rank's), median and mean after the warm-up step. `--docs` then writes
the table into docs/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402  (bench/common.py)
DOCS = ROOT / "docs" / "rollout.md"
DOCS_DIST = ROOT / "docs" / "distributed.md"
BEGIN, END = "<!-- overlap:begin -->", "<!-- overlap:end -->"


def overrides(address: str, warm: Path, data: Path, run_dir: Path, *, asynchronous: bool, steps: int,
              seed: int) -> list[str]:
    """The demo configuration on the server, one warm-up step more than measured, nothing saved."""
    return [f"model.path={warm}", f"data.path={data}", f"train.run_dir={run_dir}", f"train.steps={steps + 1}",
            f"train.seed={seed}", "train.save_every=0", "train.save_every_minutes=0", "train.sample_every=0",
            "train.progress=false", "train.check_rewards=false", "rollout.engine=server", f"rollout.server={address}",
            f"rollout.async={str(asynchronous).lower()}", "data.eval_split=0",
            "algorithm.kl.beta=0", "algorithm.kl.measure_every=0"]     # as measured in docs/rollout.md


def summary(name: str, times: list[float], rows: list[dict]) -> dict:
    """Step times (after the warm-up step) and the measured steps' metrics."""
    return {"mode": name, "steps": len(times), "step_s_median": statistics.median(times),
            "step_s_mean": statistics.fmean(times),
            "rollout_wait_s_mean": statistics.fmean(r["time/rollout"] for r in rows),
            "update_s_mean": statistics.fmean(r["time/update"] for r in rows),
            "staleness": sorted({r.get("rollout/staleness") for r in rows}),
            "reward_mean_last5": statistics.fmean(r["reward/mean"] for r in rows[-5:])}


def run_mode(address: str, warm: Path, data: Path, work: Path, *, asynchronous: bool, steps: int, seed: int) -> dict:
    import torch

    from grpokit.config import load_config
    from grpokit.train import build_run
    from grpokit.models import load_model, load_tokenizer

    name = "async" if asynchronous else "on_policy"
    cfg = load_config(["demo"], overrides(address, warm, data, work / name, asynchronous=asynchronous, steps=steps,
                                          seed=seed))
    torch.manual_seed(seed)
    tr = build_run(cfg, model=load_model(warm, dtype="float32", device="cpu"), tokenizer=load_tokenizer(warm),
                   health=False, report=False)
    marks, rows = [time.perf_counter()], []

    def progress(step, metrics):
        marks.append(time.perf_counter())
        rows.append(metrics)

    tr.train(progress=progress)
    tr.engine.close()
    return summary(name, [b - a for a, b in zip(marks[1:], marks[2:])], rows[1:])    # after the warm-up step


def run_mode_ranks(nproc: int, address: str, warm: Path, data: Path, work: Path, *, asynchronous: bool,
                   steps: int, seed: int) -> dict:
    """The same configuration as a torchrun job of `nproc` ranks; step times from its metrics."""
    import subprocess

    from grpokit.train.distributed import free_port

    name = "async" if asynchronous else "on_policy"
    run_dir = work / f"{name}-{nproc}ranks"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "grpokit", "train", "demo",
            *overrides(address, warm, data, run_dir, asynchronous=asynchronous, steps=steps, seed=seed),
            "train.eval_every=0", "train.dist_timeout_s=300"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r][1:]                # after the warm-up step
    return summary(name, [r["time/step"] for r in rows], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per mode (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the trainer and for the server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-overlap"))
    ap.add_argument("--nproc", type=int, default=1, help="trainer ranks (torchrun, FSDP2) sharing the server")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/rollout.md (--nproc > 1: distributed.md)")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from grpokit.demo import DemoSettings, warm_start
    from grpokit.tasks.arithmetic import ArithmeticTask

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    s = DemoSettings(seed=args.seed)
    task = ArithmeticTask(seed=args.seed, carry_frac=s.carry_frac, teacher_correct=s.teacher_correct, heldout=s.heldout)
    warm = warm_start(s, task, work, say=print)
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in task.train_rows(20000, args.seed + 7)))
    proc, address = common.start_rollout_server(warm, work / "server.log", threads=args.threads)
    try:
        if args.nproc > 1:
            results = [run_mode_ranks(args.nproc, address, warm, data, work, asynchronous=a, steps=args.steps,
                                      seed=args.seed) for a in (False, True)]
        else:
            results = [run_mode(address, warm, data, work, asynchronous=a, steps=args.steps, seed=args.seed)
                       for a in (False, True)]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    on, off = results
    ratio = on["step_s_median"] / off["step_s_median"]
    out = {"results": results, "ratio_on_policy_over_async_median": ratio,
           "ratio_on_policy_over_async_mean": on["step_s_mean"] / off["step_s_mean"],
           "threads": args.threads, "nproc": args.nproc, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(out, indent=2))
    (work / f"overlap{'-%dranks' % args.nproc if args.nproc > 1 else ''}.json").write_text(json.dumps(out, indent=2))
    if args.docs:
        table = ["| mode | step time, median (s) | mean (s) | rollout wait, mean (s) | update, mean (s) | staleness |",
                 "|---|---|---|---|---|---|"]
        for r in results:
            table.append(f"| {r['mode'].replace('_', '-')} | {r['step_s_median']:.3f} | {r['step_s_mean']:.3f} | "
                         f"{r['rollout_wait_s_mean']:.3f} | {r['update_s_mean']:.3f} | {r['staleness']} |")
        table.append("")
        who = (f"{args.nproc} trainer ranks (FSDP2) with one thread each and the server with {args.threads}"
               if args.nproc > 1 else f"{args.threads} torch thread(s) for the trainer and for the server")
        flags = f" --nproc {args.nproc}" if args.nproc > 1 else ""
        table.append(f"On-policy / async step time: **{ratio:.2f}x** (median; mean {out['ratio_on_policy_over_async_mean']:.2f}x); "
                     f"{args.steps} steps per mode after one warm-up, {who}, {out['cpus']} CPUs, {out['date']} "
                     f"(`python bench/overlap.py --steps {args.steps}{flags}`).")
        docs = DOCS_DIST if args.nproc > 1 else DOCS
        text = docs.read_text()
        i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
        docs.write_text(text[:i] + "\n" + "\n".join(table) + "\n" + text[j:])


if __name__ == "__main__":
    main()
