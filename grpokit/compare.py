"""`grpokit compare PRESET...`: the variants side by side on the demo task.

Every preset starts from the same warm-started model (the demo's, cached), the same prompts, the
same held-out set and the same step budget, for each seed. Writes `RUN_DIR/compare.md` (a table of
means and spreads over seeds), `RUN_DIR/compare.json` and `RUN_DIR/compare.png` (held-out greedy
accuracy and mean response length over steps, one line per preset), plus each run's directory.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from grpokit.config import load_config
from grpokit.data.datasets import PromptDataset
from grpokit.demo import DemoSettings, accuracy, warm_start
from grpokit.monitor.sinks import read_metrics
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.models import load_model, load_tokenizer


def label(preset: str) -> str:
    """A preset's name in tables and run directories: a YAML file's stem, else the name itself."""
    return Path(preset).stem if preset.endswith((".yaml", ".yml")) else preset


def run_one(preset: str, seed: int, s: DemoSettings, root: Path, steps: int, eval_every: int, say) -> dict:
    from grpokit.train import build_run

    task = ArithmeticTask(seed=seed, carry_frac=s.carry_frac, teacher_correct=s.teacher_correct, heldout=s.heldout)
    held = task.heldout_rows()
    warm_dir = warm_start(s, task, root, say)
    data = root / f"train-{seed}.jsonl"
    if not data.is_file():
        data.write_text("".join(json.dumps(r) + "\n" for r in task.train_rows(20000, seed + 7)))
    run_dir = root / f"{label(preset)}-seed{seed}"
    cfg = load_config(["demo", preset], [f"model.path={warm_dir}", f"data.path={data}", f"train.steps={steps}",
                                         f"train.seed={seed}", f"train.run_dir={run_dir}", "train.progress=false",
                                         f"train.eval_every={eval_every}", "train.save_every=0"])
    tok = load_tokenizer(warm_dir)
    trainer = build_run(cfg, model=load_model(warm_dir, dtype="float32", device="cpu"), tokenizer=tok,
                        eval_dataset=PromptDataset(held), report=False)     # the comparison has its own
    model = trainer.model
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(run_dir) if "completion/length_mean" in r]   # training rows (not eval-only)
    kl = [r["kl/ref"] for r in rows if "kl/ref" in r]
    return {
        "preset": label(preset), "seed": seed, "wall_seconds": wall,
        "greedy_accuracy": accuracy(model, tok, held),
        "sampled_accuracy": accuracy(model, tok, held, temperature=cfg.rollout.temperature, n=4, seed=seed),
        "length_mean": statistics.mean(r["completion/length_mean"] for r in rows[-10:]),
        "kl_final": kl[-1] if kl else 0.0,
        "curve": [(r["step"], r.get("eval/pass@1"), r["completion/length_mean"]) for r in rows],
    }


def _fmt(vals: list[float], pct: bool = False) -> str:
    m = statistics.mean(vals)
    spread = (max(vals) - min(vals)) / 2 if len(vals) > 1 else 0.0
    unit = "%" if pct else ""
    return f"{m:.1f}{unit} ± {spread:.1f}" if pct else f"{m:.3g} ± {spread:.2g}"


def compare(presets: list[str], *, seeds: list[int], steps: int = 60, eval_every: int = 10,
            run_dir: str | Path = "runs/compare", settings: DemoSettings | None = None, say=print) -> dict:
    """Run every preset for every seed from the demo's warm start (`settings`: the demo's by default;
    tests pass a smaller one) and write the table, the JSON rows and the chart under `run_dir`."""
    for p in presets:               # a misspelt preset or a bad YAML file: one line before the warm start
        load_config(p)
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in seeds:
        s = replace(settings, seed=seed) if settings is not None else DemoSettings(seed=seed)
        for p in presets:
            say(f"compare: {p} seed {seed}")
            results.append(run_one(p, seed, s, root, steps, eval_every, say))
    lines = ["| preset | held-out greedy acc. | sampled acc. | mean length | final KL | wall s |",
             "|---|---|---|---|---|---|"]
    names = [label(p) for p in presets]
    for name in names:
        rs = [r for r in results if r["preset"] == name]
        lines.append(f"| {name} | {_fmt([r['greedy_accuracy'] for r in rs], True)} | "
                     f"{_fmt([r['sampled_accuracy'] for r in rs], True)} | {_fmt([r['length_mean'] for r in rs])} | "
                     f"{_fmt([r['kl_final'] for r in rs])} | {_fmt([r['wall_seconds'] for r in rs])} |")
    table = "\n".join(lines)
    header = (f"Demo task, {steps} GRPO steps from the same warm start, seeds {seeds}; mean ± half-range over seeds. "
              f"Accuracy in percent on {(settings or DemoSettings()).heldout} held-out problems.\n\n")
    (root / "compare.md").write_text(header + table + "\n")
    (root / "compare.json").write_text(json.dumps(results, indent=1))
    _chart(results, names, root / "compare.png")
    say(header + table)
    say(f"chart: {root / 'compare.png'}")
    return {"table": table, "results": results}


def _chart(results: list[dict], names: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        rs = [r for r in results if r["preset"] == name]
        acc: dict[int, list[float]] = {}
        length: dict[int, list[float]] = {}
        for r in rs:
            for step, a, ln in r["curve"]:
                if a is not None:
                    acc.setdefault(step, []).append(100 * a)
                length.setdefault(step, []).append(ln)
        xs = sorted(acc)
        ax1.plot(xs, [statistics.mean(acc[x]) for x in xs], marker="o", label=name)
        xs = sorted(length)
        ax2.plot(xs, [statistics.mean(length[x]) for x in xs], label=name)
    ax1.set(title="held-out greedy accuracy (%)", xlabel="step")
    ax2.set(title="mean response length (tokens)", xlabel="step")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
