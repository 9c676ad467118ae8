"""`grpokit` command line: train, eval, demo, compare, report, plan-memory.

A user error (bad config key, missing file, malformed dataset row, unloadable model) prints one line
and exits with code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

EXAMPLES = """examples:
  grpokit demo                                   # the embedded demo (tiny model, arithmetic)
  grpokit demo --quick                           # about a minute
  grpokit train presets/grpo.yaml model.path=./my-model data.path=prompts.jsonl
  grpokit train my.yaml algorithm.eps_high=0.28 rollout.group_size=8 --resume
  grpokit eval --model runs/grpo/checkpoints/step_000100 --data heldout.jsonl
  grpokit compare grpo dr_grpo dapo reinforce grpo_buckets --seeds 0 1 2
  grpokit report runs/grpo
  grpokit plan-memory my.yaml --budget 24GiB --device cuda --apply
"""


def _user_errors() -> tuple[type[BaseException], ...]:
    from grpokit.config import ConfigError
    from grpokit.data.datasets import DataError
    from grpokit.train.model import ModelLoadError
    return (ConfigError, DataError, ModelLoadError, FileNotFoundError)


def cmd_train(args) -> int:
    from grpokit.config import load_config
    from grpokit.train import build_trainer

    cfg = load_config(args.config, args.overrides)
    trainer = build_trainer(cfg)
    if args.resume and not (Path(cfg.train.run_dir) / "checkpoints").is_dir():
        print(f"note: --resume: no checkpoint in {cfg.train.run_dir}; starting fresh", file=sys.stderr)
    try:
        if cfg.train.progress:
            from grpokit.cli_progress import StepProgress
            with StepProgress(cfg.train.steps) as bar:
                trainer.train(resume=args.resume, progress=bar.update)
        else:
            trainer.train(resume=args.resume)
    finally:              # a run that stops with an error (divergence, reference drift) gets one too
        _write_report(cfg.train.run_dir)
    print(f"done: {trainer.step_idx} steps; run directory {cfg.train.run_dir}")
    return 0


def _write_report(run_dir) -> None:
    """Write RUN_DIR/report.html. A failure is logged, never raised: it must neither lose a finished
    run nor hide the error that stopped one."""
    try:
        from grpokit.monitor.report import write_report
        path = write_report(run_dir)
        print(f"report: {path}")
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("grpokit").warning("could not write the report: %s", exc)


def cmd_eval(args) -> int:
    from grpokit.config import load_config
    from grpokit.data.datasets import PromptDataset, load_prompts
    from grpokit.train import build_rewards
    from grpokit.rollout.registry import build_engine
    from grpokit.train.build import load_model, load_tokenizer
    from grpokit.train.evaluate import evaluate
    from grpokit.train.prompts import PromptEncoder

    over = [f"model.path={args.model}", f"data.path={args.data}"] + args.overrides
    cfg = load_config(args.config, over)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, dtype=cfg.model.dtype, device=cfg.model.device)
    ds = load_prompts(args.data, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field)
    rewards = build_rewards(cfg)
    import torch
    engine = build_engine(cfg.rollout.engine, model, tok, **cfg.rollout.engine_options())
    res = evaluate(engine, PromptEncoder(tok, cfg.data.chat_template), rewards,
                   PromptDataset(ds.rows), cfg, samples=args.samples, generator=torch.Generator().manual_seed(cfg.train.seed))
    print(json.dumps({"model": args.model, "data": args.data, "prompts": len(ds), **res}, indent=2))
    return 0


def cmd_demo(args) -> int:
    from grpokit.demo import run_demo

    grpo_dir = Path(args.run_dir) / "grpo"
    try:
        run_demo(quick=args.quick, control=args.control, seed=args.seed, run_dir=args.run_dir,
                 overrides=args.overrides, progress=not args.no_progress)
    finally:
        if grpo_dir.is_dir():    # absent when the demo failed before training
            _write_report(grpo_dir)
    return 0


def cmd_compare(args) -> int:
    from grpokit.compare import compare

    compare(args.presets, seeds=args.seeds, steps=args.steps, eval_every=args.eval_every, run_dir=args.run_dir)
    return 0


def cmd_plan_memory(args) -> int:
    """Estimate peak memory; apply the memory order of cuts until the budget is met (docs/memory.md)."""
    from grpokit.config import load_config, parse_override
    from grpokit.train import memory as mem

    cfg = load_config(args.config, args.overrides)
    shape = mem.load_shape(cfg.model.path)
    setup = mem.setup_from_config(cfg, device=args.device, prompt_tokens=args.prompt_tokens or mem.prompt_tokens_of(cfg))
    budget = mem.parse_size(args.budget) if args.budget else mem.default_budget(setup.device)
    rows = mem.plan(shape, setup, budget, lr=cfg.optim.lr, prompts_per_step=cfg.prompts_per_step,
                    mini_batches=cfg.algorithm.mini_batches)
    print(mem.format_plan(rows, budget))
    fit = mem.first_fit(rows, budget)
    if fit is not None and fit.overrides.get("lora.load_in_4bit"):
        from grpokit.train.lora import four_bit_unavailable
        why = four_bit_unavailable(setup.device) if setup.device == "cpu" or _has_cuda() else None
        if why:
            print(f"note: {why}")
    if args.apply:
        if fit is None:
            print("--apply: nothing fits the budget; no file written", file=sys.stderr)
            return 1
        given = {".".join(k): v for k, v in map(parse_override, args.overrides)}
        src = Path(args.config[-1]) if args.config else None
        out = Path(args.out) if args.out else Path(f"{src.stem if src else 'plan'}.fit.yaml")
        if src is not None and src.is_file():
            base = [str(Path(c).resolve()) if Path(c).is_file() else c for c in args.config]
        else:
            base = list(args.config)
        out.write_text(mem.overrides_yaml({**given, **fit.overrides}, base if len(base) != 1 else base[0]))
        print(f"wrote {out}: grpokit train {out}")
    if args.measure:
        from grpokit.train.memory_probe import measure
        over = args.overrides + [f"{k}={mem._yaml_value(v)}" for k, v in (fit.overrides if fit else {}).items()]
        got = measure(args.config, over, steps=args.measure)
        est = (fit or rows[0]).peak
        line = f"measured ({args.measure} steps): peak RSS {got['peak_rss_mib']:.0f} MiB"
        if "cuda_peak_mib" in got:
            line += f", cuda max_memory_allocated {got['cuda_peak_mib']:.0f} MiB"
        print(line + f"; estimate {est / mem.MiB:.0f} MiB")
    return 0 if fit is not None else 1


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def cmd_report(args) -> int:
    from grpokit.monitor.report import write_report

    if not Path(args.run_dir).is_dir():
        raise FileNotFoundError(f"run directory not found: {args.run_dir}")
    print(write_report(args.run_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpokit", description="GRPO-family post-training of causal LMs.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train with a YAML config (or preset name) and key=value overrides")
    t.add_argument("config", nargs="+", help="config file(s) or preset names, then key.sub=value overrides")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of train.run_dir")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="held-out pass@1 of a model directory on a prompt file")
    e.add_argument("--model", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--config", default=None, help="config whose rewards/rollout settings to use")
    e.add_argument("--samples", type=int, default=0, help="also sampled mean@k with k samples")
    e.add_argument("overrides", nargs="*")
    e.set_defaults(fn=cmd_eval)

    d = sub.add_parser("demo", help="the embedded demo: GRPO on a tiny model, nothing downloaded")
    d.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    d.add_argument("--control", action="store_true", help="also run supervised-only training for the same time")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("overrides", nargs="*", help="key=value overrides of the demo's GRPO config")
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser("compare", help="run presets side by side on the demo task")
    c.add_argument("presets", nargs="+", help="preset names or YAML files (e.g. grpo dr_grpo dapo)")
    c.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    c.add_argument("--steps", type=int, default=60)
    c.add_argument("--eval-every", type=int, default=10)
    c.add_argument("--run-dir", default="runs/compare")
    c.set_defaults(fn=cmd_compare)

    pm = sub.add_parser("plan-memory", help="estimate peak memory and the order of cuts that fits a budget")
    pm.add_argument("config", nargs="+", help="config file(s) or preset names, then key.sub=value overrides")
    pm.add_argument("--budget", default=None, help="memory to fit, e.g. 24GiB (default: this GPU's or RAM's size)")
    pm.add_argument("--device", choices=["cpu", "cuda"], default=None, help="plan for this device (default: model.device)")
    pm.add_argument("--prompt-tokens", type=int, default=None,
                    help="longest prompt in tokens (default: measured on data.path, else 256)")
    pm.add_argument("--apply", action="store_true", help="write the first fitting configuration as a YAML file")
    pm.add_argument("--out", default=None, help="where --apply writes (default: CONFIG.fit.yaml here)")
    pm.add_argument("--measure", type=int, nargs="?", const=2, default=0, metavar="STEPS",
                    help="also run STEPS (2) training steps of the fitting configuration here and report its peak")
    pm.set_defaults(fn=cmd_plan_memory)

    r = sub.add_parser("report", help="write RUN_DIR/report.html")
    r.add_argument("run_dir")
    r.set_defaults(fn=cmd_report)
    return p


def _split_train_args(args) -> None:
    if args.cmd in ("train", "plan-memory"):
        args.overrides = [a for a in args.config if "=" in a]
        args.config = [a for a in args.config if "=" not in a]


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers ("Loading weights", "Writing model shards"): the
    models grpokit loads and saves are local and small, and the bars drown the run's own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _split_train_args(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.debug:
        _quiet_transformers()
    try:
        return args.fn(args)
    except _user_errors() as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
