"""`grpokit` command line: train, eval, demo, compare, report, plan-memory, convert, export,
rollout-server.

A user error (bad config key, missing file, malformed dataset row, unloadable model) prints one line
and exits with code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from grpokit.errors import ConfigError

EXAMPLES = """examples:
  grpokit demo                                   # the embedded demo (tiny model, arithmetic)
  grpokit demo --quick                           # about a minute
  grpokit train presets/grpo.yaml model.path=./my-model data.path=prompts.jsonl
  grpokit train my.yaml algorithm.eps_high=0.28 rollout.group_size=8 --resume
  grpokit eval --model runs/grpo/checkpoints/step_000100 --data heldout.jsonl
  grpokit compare grpo dr_grpo dapo reinforce grpo_buckets --seeds 0 1 2
  grpokit report runs/grpo
  grpokit train my.yaml --nproc 2                # 2 processes (torchrun; FSDP2)
  grpokit export runs/grpo/checkpoints/step_000100 ./my-model-grpo
  grpokit plan-memory my.yaml --budget 24GiB --device cuda --apply
  grpokit convert model.Q4_1.gguf ./my-model     # a GGUF file as a plain Hugging Face directory
  grpokit rollout-server --model ./my-model --port 8000   # then: train ... rollout.engine=server rollout.server=HOST:8000
"""


def _user_errors() -> tuple[type[BaseException], ...]:
    from grpokit.data.datasets import DataError
    from grpokit.models.hf import ModelLoadError
    return (ConfigError, DataError, ModelLoadError, FileNotFoundError, FileExistsError)


def _run_errors() -> tuple[type[BaseException], ...]:
    from grpokit.rollout.client import RolloutServerError
    return (RolloutServerError,)


def cmd_train(args) -> int:
    from grpokit.config import load_config
    from grpokit.rollout.client import RolloutServerError
    from grpokit.train import build_run
    from grpokit.train.checkpoint import nothing_to_resume

    cfg = load_config(args.config, args.overrides)
    if args.resume and (problem := nothing_to_resume(cfg.train.run_dir)):
        raise ConfigError(problem)          # before the model loads (and before any rank starts)
    if args.nproc is not None:
        return _launch(args, cfg)
    trainer = build_run(cfg)                # the report and leaving the job: when `train` ends
    try:
        trainer.train(resume=args.resume)
    except RolloutServerError as exc:
        from grpokit.train.checkpoint import latest_checkpoint
        ck = latest_checkpoint(cfg.train.run_dir)
        raise RolloutServerError(f"{exc}. The run stopped at step {trainer.step_idx}; its last checkpoint is "
                                 f"{ck if ck is not None else 'none'}: restart the rollout server and run again "
                                 "with --resume") from None
    if trainer.comm.is_main:                # rank 0 alone prints and reports
        print(f"done: {trainer.step_idx} steps; run directory {cfg.train.run_dir}")
    return 0


def _launch(args, cfg) -> int:
    """`grpokit train ... --nproc N`: the same command on N local ranks under torchrun."""
    import os

    from grpokit.config import ConfigError
    from grpokit.train import distributed
    from grpokit.train.launch import launch

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if "RANK" in os.environ:
        raise ConfigError("--nproc inside a torchrun job: launch either with torchrun or with --nproc, not both")
    distributed.check_config(cfg, args.nproc)
    argv = ["train", *args.config, *args.overrides] + (["--resume"] if args.resume else [])
    if args.debug:
        argv.insert(0, "--debug")
    return launch(args.nproc, argv)


def cmd_eval(args) -> int:
    import torch

    from grpokit.config import load_config
    from grpokit.train import build_eval
    from grpokit.train.evaluate import evaluate

    over = [f"model.path={args.model}", f"data.path={args.data}", "data.eval_path="] + args.overrides
    cfg = load_config(args.config, over)
    engine, encoder, rewards, ds, episodes = build_eval(cfg, args.model)
    res = evaluate(engine, encoder, rewards, ds, cfg, samples=args.samples,
                   generator=torch.Generator().manual_seed(cfg.train.seed), episodes=episodes)
    print(json.dumps({"model": args.model, "data": args.data, "prompts": len(ds), **res}, indent=2))
    return 0


def cmd_demo(args) -> int:
    from grpokit.demo import run_demo

    if Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
        raise ConfigError(f"--run-dir {args.run_dir} is a file, not a directory")
    run_demo(quick=args.quick, control=args.control, seed=args.seed, run_dir=args.run_dir,
             overrides=args.overrides, progress=not args.no_progress)     # its run writes grpo/report.html
    return 0


def cmd_compare(args) -> int:
    from grpokit.compare import compare

    compare(args.presets, seeds=args.seeds, steps=args.steps, eval_every=args.eval_every, run_dir=args.run_dir)
    return 0


def cmd_plan_memory(args) -> int:
    """Estimate peak memory; apply the memory order of cuts until the budget is met (docs/memory.md)."""
    from grpokit.config import ConfigError, load_config, parse_override
    from grpokit.train import memory as mem
    from grpokit.train import memory_plan as memplan

    cfg = load_config(args.config, args.overrides)
    shape = mem.load_shape(cfg.model.path, cfg.model.gguf_file)
    if args.world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
    if args.world_size > 1:
        from grpokit.train.distributed import check_config
        check_config(cfg, args.world_size)
    setup = mem.setup_from_config(cfg, device=args.device, prompt_tokens=args.prompt_tokens or mem.prompt_tokens_of(cfg),
                                  world_size=args.world_size)
    budget = mem.parse_size(args.budget) if args.budget else mem.default_budget(setup.device)
    rows = memplan.plan(shape, setup, budget, lr=cfg.optim.lr, prompts_per_step=cfg.prompts_per_step,
                    mini_batches=cfg.algorithm.mini_batches)
    print(memplan.format_plan(rows, budget))
    fit = memplan.first_fit(rows, budget)
    if fit is not None and fit.overrides.get("lora.load_in_4bit"):
        from grpokit.models.lora import four_bit_unavailable
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
        out.write_text(memplan.overrides_yaml({**given, **fit.overrides}, base if len(base) != 1 else base[0]))
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


def cmd_export(args) -> int:
    """A checkpoint (of any world size; LoRA adapters merged) as a plain Hugging Face directory."""
    from grpokit.models import load_model, load_tokenizer
    from grpokit.train.checkpoint import MARKER
    from grpokit.models import sharded
    from grpokit.models.lora import is_peft, save_merged

    ckpt, out = Path(args.checkpoint), Path(args.out)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint not found: {ckpt}")
    if (ckpt.parent.name == "checkpoints" or ckpt.name.startswith("step_")) and not (ckpt / MARKER).is_file():
        raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no {MARKER} marker: its save was interrupted)")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    if sharded.is_sharded(ckpt):                              # an FSDP2 run's shards (DCP)
        model = sharded.plain_model(ckpt)
    else:
        model = load_model(ckpt, dtype="auto", device="cpu")  # adapters: their base, merged
    if is_peft(model):
        save_merged(model, out)
    else:
        model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(ckpt).save_pretrained(out)
    print(f"exported {ckpt} to {out}")
    return 0


def cmd_rollout_server(args) -> int:
    from grpokit.rollout.server import ServerLimits, serve

    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * 2**20), max_completions=args.max_completions,
                          max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                          max_batch_tokens=args.max_batch_tokens, max_in_flight=args.max_in_flight,
                          max_connections=args.max_connections,
                          max_connections_per_address=args.max_connections_per_address, io_timeout_s=args.io_timeout)
    serve(args.model, backend=args.backend, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
          api_key=args.api_key, insecure=args.insecure, limits=limits)
    return 0


def cmd_report(args) -> int:
    from grpokit.monitor.report import write_report

    run = Path(args.run_dir)
    if not run.exists():
        raise ConfigError(f"run directory not found: {run}")
    if not run.is_dir():
        raise ConfigError(f"{run} is a file; grpokit report takes a run directory (train.run_dir)")
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{run} is not a run directory: no metrics.jsonl (give the train.run_dir of a run)")
    if not metrics.read_text().strip():
        raise ConfigError(f"{metrics} is empty: the run has not finished a step yet")
    print(write_report(run))
    return 0


def _count(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def cmd_convert(args) -> int:
    from grpokit.models.gguf import convert

    out = convert(args.gguf, args.out_dir)
    print(f"wrote {out} (a plain Hugging Face directory: model.path={out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpokit", description="GRPO-family post-training of causal LMs.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train with a YAML config (or preset name) and key=value overrides")
    t.add_argument("config", nargs="+", help="config file(s) or preset names, then key.sub=value overrides")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of train.run_dir")
    t.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train on N local processes (starts torchrun; see docs/distributed.md)")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="held-out pass@1 of a model directory on a prompt file")
    e.add_argument("--model", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--config", default=None, help="config whose rewards/rollout settings to use")
    e.add_argument("--samples", type=_count, default=0, help="also sampled mean@k with k samples")
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
    pm.add_argument("--prompt-tokens", type=_count, default=None,
                    help="longest prompt in tokens (default: measured on data.path, else 256)")
    pm.add_argument("--world-size", type=int, default=1, metavar="N",
                    help="per-rank memory of an N-process run (train.distributed: FSDP2 shards weights, "
                         "gradients and optimizer state; docs/distributed.md)")
    pm.add_argument("--apply", action="store_true", help="write the first fitting configuration as a YAML file")
    pm.add_argument("--out", default=None, help="where --apply writes (default: CONFIG.fit.yaml here)")
    pm.add_argument("--measure", type=int, nargs="?", const=2, default=0, metavar="STEPS",
                    help="also run STEPS (2) training steps of the fitting configuration here and report its peak")
    pm.set_defaults(fn=cmd_plan_memory)

    x = sub.add_parser("export", help="write a checkpoint as a plain Hugging Face model directory")
    x.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N (from any number of processes; LoRA merged)")
    x.add_argument("out", help="an empty or new directory")
    x.set_defaults(fn=cmd_export)

    rs = sub.add_parser("rollout-server", help="serve rollouts to a trainer in another process (rollout.engine: server)")
    rs.add_argument("--model", required=True, help="local Hugging Face model directory (the policy's starting weights)")
    rs.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                    help="the engine: transformers (hf) or the in-process vLLM engine (vllm)")
    rs.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (also for the weight group); other than loopback it needs an API key")
    rs.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one, printed)")
    rs.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:N]")
    rs.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    sec = rs.add_argument_group("access (docs/rollout.md, Running across machines)")
    sec.add_argument("--api-key", default=None,
                     help="key every request must carry (Authorization: Bearer KEY); better: the GRPOKIT_API_KEY "
                          "environment variable, which stays out of process listings")
    sec.add_argument("--insecure", action="store_true",
                     help="serve a non-loopback --host without an API key (anyone who reaches the port can use it)")
    from grpokit.rollout.serving import ServerLimits   # the standard library only: cheap at parse time
    d = ServerLimits()
    lim = rs.add_argument_group("limits")
    lim.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20, help="largest request body (default %(default)g)")
    lim.add_argument("--max-completions", type=int, default=d.max_completions, help="prompts x n per request (default %(default)s)")
    lim.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="longest prompt (default %(default)s)")
    lim.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="largest max_new_tokens (default %(default)s)")
    lim.add_argument("--max-batch-tokens", type=int, default=None,
                     help="completions x (longest prompt + max_new_tokens) per request (default: what 80%% of the "
                          "memory free at start holds as KV cache, hf backend)")
    lim.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                     help="requests served at once; more get 503 (default %(default)s)")
    lim.add_argument("--max-connections", type=int, default=d.max_connections,
                     help="open connections; more get 503 (default %(default)s)")
    lim.add_argument("--max-connections-per-address", type=int, default=None,
                     help="open connections from one client address (default: half of --max-connections)")
    lim.add_argument("--io-timeout", type=float, default=d.io_timeout_s,
                     help="seconds to receive a whole request or send an answer (default %(default)g)")
    rs.set_defaults(fn=cmd_rollout_server)

    r = sub.add_parser("report", help="write RUN_DIR/report.html")
    r.add_argument("run_dir")
    r.set_defaults(fn=cmd_report)

    cv = sub.add_parser("convert", help="write a GGUF file as a plain Hugging Face model directory")
    cv.add_argument("gguf", help="the .gguf file (its weights are dequantized to float32)")
    cv.add_argument("out_dir", help="output directory (absent or empty)")
    cv.set_defaults(fn=cmd_convert)
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
    args, extra = parser.parse_known_args(argv)
    if extra and args.cmd in ("train", "plan-memory") and all("=" in a for a in extra):
        args.config += extra            # overrides after a flag: `train cfg.yaml --resume key=value`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _split_train_args(args)
    rank = os.environ.get("RANK", "0")          # under torchrun, ranks other than 0 log warnings only
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=("%(levelname)s %(name)s: " if rank == "0" else f"%(levelname)s rank {rank} %(name)s: ")
                        + "%(message)s")
    if not args.debug:
        _quiet_transformers()
    from grpokit.train.launch import report_rank_error
    try:
        return args.fn(args)
    except _user_errors() as exc:
        report_rank_error(str(exc))
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except _run_errors() as exc:       # the run stopped; its last checkpoint is intact
        report_rank_error(str(exc))
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:           # a bug or a failure of the run: Python's traceback follows
        report_rank_error(f"{type(exc).__name__}: {exc}")
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
