"""The same GRPO work in each training/generation layout: where a step's time goes, per layout.

    .venv/bin/python bench/layouts.py --smoke                      # a tiny model on CPU: the script's own check
    .venv-vllm/bin/python bench/layouts.py --size qwen05b --out F  # on a GPU (bench/gpu/run.sh)

Layouts (each a `grpokit train` run of `--steps` steps on the same model, prompts and settings):
  hf      one process, generation with the training model itself (`rollout.engine: hf`)
  vllm    one process, vLLM colocated over its own copy of the weights (`rollout.engine: vllm`)
  server  a `grpokit rollout-server` process on the same device (`rollout.engine: server`),
          weights pushed over the weight group after every step
  trl     TRL's GRPOTrainer on the same work, vLLM colocated on GPU (bench/layouts_trl.py, run
          with `--trl-python`, the interpreter of an environment holding trl)
A layout whose engine is missing here (vLLM, TRL) is skipped with the reason. The model is built
offline and seeded (grpokit's character tokenizer, Qwen2 shapes: `--size tiny` / `qwen05b`, the
layer shapes of Qwen2.5-0.5B, 0.36 B parameters), or `--model DIR`. Completions have a fixed length
(`ignore_eos`), so every layout generates the same number of tokens.

Reported per layout, over the steps after the first (warm-up): trajectories/s and completion
tokens/s of the whole step, and the step split into generation (`time/rollout`), training
(`time/logprobs` + `time/update`) and weight sync (`time/sync`), from the run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402

SIZES = {"tiny": dict(hidden=64, layers=2, heads=4, intermediate=128),
         "qwen05b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864)}
LAYOUTS = ("hf", "vllm", "server", "trl")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, CPU: checks the script itself")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local Hugging Face causal-LM directory")
    src.add_argument("--size", choices=sorted(SIZES), default="qwen05b")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--trl-python", default="", help="python of an environment with trl (default: skip trl)")
    ap.add_argument("--out", default="", help="write the results here (JSON)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.model, args.steps, args.prompts, args.group_size, args.max_new_tokens = "tiny", None, 3, 4, 4, 16
        args.device = "cpu"
    return args


def build_inputs(args, root: Path) -> tuple[Path, Path]:
    from grpokit.tasks.arithmetic import ArithmeticTask
    from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained

    if args.model:
        model_dir = Path(args.model)
    else:
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, arch="qwen2", max_positions=1024, seed=0, **SIZES[args.size])
        model_dir = save_pretrained(model, tok, root / f"model-{args.size}")
    data = root / "train.jsonl"
    rows = ArithmeticTask(seed=0, heldout=0).train_rows(max(args.prompts * (args.steps + 1), 64), 0)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def overrides(args, model_dir: Path, data: Path, run_dir: Path, engine: str, extra=()) -> list[str]:
    return [f"model.path={model_dir}", f"model.device={args.device}", f"data.path={data}", f"train.run_dir={run_dir}",
            f"rollout.engine={engine}", f"rollout.group_size={args.group_size}",
            f"rollout.batch_size={args.prompts * args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
            "rollout.ignore_eos=true", "rollout.temperature=1.0", f"train.steps={args.steps}", "train.eval_every=0",
            "train.save_every=0", "train.save_every_minutes=0", "train.sample_every=0", "train.progress=false",
            "train.check_rewards=false", "train.batch_advice=false", "data.eval_split=0", "monitor.sinks=[jsonl]",
            "rewards=[{name: exact_match}]", "optim.lr=1e-5", "algorithm.kl.beta=0.02", *extra]


def summarise(rows: list[dict], trajectories: int) -> dict:
    """Means over the steps after the first."""
    rows = rows[1:] or rows

    def mean(key):
        vals = [r.get(key, 0.0) for r in rows]
        return statistics.fmean(vals) if vals else 0.0

    step = mean("time/step")
    tokens = mean("completion/length_mean") * trajectories
    return {"steps": len(rows), "step_s": step, "trajectories_per_s": trajectories / step if step else 0.0,
            "tokens_per_s": tokens / step if step else 0.0, "generation_s": mean("time/rollout"),
            "training_s": mean("time/logprobs") + mean("time/update"), "sync_s": mean("time/sync"),
            "sync_mb": mean("sync/mb")}


def run_grpokit(layout: str, args, model_dir: Path, data: Path, root: Path) -> dict:
    from grpokit.cli import main as grpokit_main

    run_dir = root / layout
    server = None
    try:
        extra = []
        if layout == "server":
            server, address = common.start_rollout_server(model_dir, root / "server.log", device=args.device)
            extra = [f"rollout.server={address}"]
        t0 = time.perf_counter()
        code = grpokit_main(["train", *overrides(args, model_dir, data, run_dir, layout, extra)])
        if code != 0:
            raise RuntimeError(f"grpokit train exited with {code}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "time/step" in r]
        return {"wall_s": time.perf_counter() - t0, **summarise(rows, args.prompts * args.group_size)}
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=30)


def run_trl(args, model_dir: Path, data: Path, root: Path) -> dict:
    out = root / "trl.json"
    cmd = [args.trl_python, str(ROOT / "bench" / "layouts_trl.py"), "--model", str(model_dir), "--data", str(data),
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--group-size", str(args.group_size),
           "--max-new-tokens", str(args.max_new_tokens), "--out", str(out), "--run-dir", str(root / "trl")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the TRL side failed: {(done.stderr or done.stdout)[-1500:]}")
    return json.loads(out.read_text())


def why_not(layout: str, args) -> str:
    """Why `layout` cannot run here ("" when it can)."""
    import importlib.util

    if layout == "vllm" and importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this environment (make test-vllm builds .venv-vllm)"
    if layout == "trl" and not args.trl_python:
        return "no --trl-python given (an environment with trl: make bench builds .venv-bench)"
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="grpokit-layouts-"))
    results, skipped = {}, {}
    try:
        model_dir, data = build_inputs(args, root)
        for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
            if layout not in LAYOUTS:
                raise SystemExit(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
            if why := why_not(layout, args):
                skipped[layout] = why
                print(f"{layout}: skipped: {why}", flush=True)
                continue
            results[layout] = run_trl(args, model_dir, data, root) if layout == "trl" else \
                run_grpokit(layout, args, model_dir, data, root)
            r = results[layout]
            print(f"{layout}: {r['step_s']:.3f} s a step, {r['trajectories_per_s']:.2f} trajectories/s, "
                  f"{r['tokens_per_s']:.1f} tokens/s; generation {r['generation_s']:.3f} s, training "
                  f"{r['training_s']:.3f} s, sync {r['sync_s']:.3f} s", flush=True)
        if "hf" in results:
            for layout, r in results.items():
                r["tokens_per_s_vs_hf"] = r["tokens_per_s"] / results["hf"]["tokens_per_s"]
        out = {"settings": {k: v for k, v in vars(args).items() if k != "trl_python"}, "results": results,
               "skipped": skipped}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
