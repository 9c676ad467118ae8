"""Measured peak memory of real training steps, to validate the planner (grpokit.train.memory).

Each configuration runs in a fresh Python process (`python -m grpokit.train.memory_probe run ...`):
it builds the trainer exactly as `grpokit train` does, runs a few steps (no checkpoint, no eval) and
reports its peak resident memory (VmHWM, the high-water mark of its own address space) and, on a
GPU, `torch.cuda.max_memory_allocated`.
`validation_table()` builds seeded Qwen2 models of several sizes (nothing downloaded), measures a
list of configurations and sets the planner's estimate beside each; docs/memory.md shows its output:

    python -m grpokit.train.memory_probe table --out docs/memory_measured.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MiB = 2**20


def _register_coin() -> None:
    """A reward that varies for a random model (a hash of the completion, 0 or 1): with beta = 0 the
    trainer skips samples of zero advantage, so a reward that is 0 everywhere would measure no update."""
    import zlib

    from grpokit.rewards import REGISTRY, register

    if "memory_probe_coin" not in REGISTRY:
        @register("memory_probe_coin")
        def memory_probe_coin(prompts, completions, **columns):
            return [float(zlib.crc32(c.encode()) & 1) for c in completions]


def _hwm_mib() -> float:
    """Peak resident memory of this process so far, MiB (VmHWM; ru_maxrss where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(config: list[str], overrides: list[str], steps: int) -> dict:
    """Inside the fresh process: build the trainer, run `steps` steps, report peaks."""
    import torch

    from grpokit.config import load_config
    from grpokit.train import build_trainer

    _register_coin()
    marks = {"import": _hwm_mib()}
    cfg = load_config(config, overrides)
    tr = build_trainer(cfg, health=False)
    marks["built"] = _hwm_mib()
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.step()
        tr.step_idx += 1
    # not ru_maxrss: Linux carries the parent's resident size at fork into the child's ru_maxrss
    # across exec, so a probe started from a large process (a long pytest run) would report that
    out = {"peak_rss_mib": _hwm_mib(), "marks": marks,
           "seconds": time.perf_counter() - t0, "device": str(tr.device)}
    if tr.device.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(tr.device) / MiB
    return out


def measure(config: list[str] | None, overrides: list[str], *, steps: int = 2, live: bool = False,
            timeout: float = 1800) -> dict:
    """Run `steps` training steps of a configuration in a fresh process; its peak memory (MiB).
    `live`: fix glibc's mmap threshold at 64 KiB, so freed tensors leave the process at once and the
    peak RSS follows the peak of live memory (like `torch.cuda.max_memory_allocated`); by default
    glibc's dynamic threshold keeps some freed memory in its heap, as in a normal run."""
    cmd = [sys.executable, "-m", "grpokit.train.memory_probe", "run", "--steps", str(steps),
           "--json", *(config or []), *overrides]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if live:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"measurement failed ({' '.join(overrides)}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the validation table


@dataclass
class ProbeModel:
    """A seeded Qwen2 model for the probe: `extra_chars` enlarges the vocabulary (CJK characters)."""
    name: str
    hidden: int
    layers: int
    heads: int
    extra_chars: int
    intermediate: int | None = None
    kv_heads: int | None = None


@dataclass
class ProbeCase:
    model: str
    label: str
    overrides: dict = field(default_factory=dict)


MODELS = [ProbeModel("tiny", 64, 2, 4, 0), ProbeModel("small", 256, 4, 4, 4000),
          ProbeModel("medium", 512, 8, 8, 8000, kv_heads=4)]

BASE = {"rollout.group_size": 8, "rollout.batch_size": 32, "rollout.max_new_tokens": 64, "rollout.ignore_eos": True,
        "rollout.temperature": 1.0, "optim.micro_batch_size": 16, "algorithm.kl.beta": 0.04,
        "algorithm.kl.controller": "fixed", "train.progress": False, "monitor.sinks": "[jsonl]",
        "train.sample_every": 0, "guard.ref_check_every": 0, "rewards": "[{name: memory_probe_coin}]"}

CASES = [
    ProbeCase("tiny", "full fine-tune"),
    ProbeCase("tiny", "LoRA", {"lora.enabled": True}),
    ProbeCase("small", "full fine-tune"),
    ProbeCase("small", "+ gradient checkpointing", {"model.gradient_checkpointing": True}),
    ProbeCase("small", "LoRA, adapter-off reference", {"lora.enabled": True}),
    ProbeCase("small", "LoRA + 4-bit", {"lora.enabled": True, "lora.load_in_4bit": True}),
    ProbeCase("medium", "full fine-tune"),
    ProbeCase("medium", "+ gradient checkpointing", {"model.gradient_checkpointing": True}),
    ProbeCase("medium", "full fine-tune, beta = 0 (no reference)", {"algorithm.kl.beta": 0.0, "algorithm.kl.measure_every": 0}),
    ProbeCase("medium", "LoRA, beta = 0 (no reference)", {"lora.enabled": True, "algorithm.kl.beta": 0.0, "algorithm.kl.measure_every": 0}),
    ProbeCase("medium", "LoRA, adapter-off reference", {"lora.enabled": True}),
    ProbeCase("medium", "LoRA + reference copy", {"lora.enabled": True, "lora.reference": "copy"}),
    ProbeCase("medium", "LoRA + gradient checkpointing", {"lora.enabled": True, "model.gradient_checkpointing": True}),
    ProbeCase("medium", "LoRA + 4-bit", {"lora.enabled": True, "lora.load_in_4bit": True}),
    ProbeCase("medium", "LoRA, G = 16, 256 new tokens", {"lora.enabled": True, "rollout.group_size": 16,
                                                          "rollout.batch_size": 64, "rollout.max_new_tokens": 256}),
]
QUICK_CASES = [c for c in CASES if c.model in ("tiny", "small")]


def build_probe_model(spec: ProbeModel, root: Path) -> Path:
    """Save a seeded Qwen2 model + char tokenizer (vocabulary enlarged with CJK characters)."""
    from grpokit.tasks.tiny import DEFAULT_CHARS, build_char_tokenizer, build_tiny_model, save_pretrained

    d = Path(root) / f"model-{spec.name}"
    if (d / "config.json").is_file():
        return d
    tok = build_char_tokenizer(DEFAULT_CHARS + "".join(chr(0x4E00 + i) for i in range(spec.extra_chars)))
    model = build_tiny_model(tok, hidden=spec.hidden, layers=spec.layers, heads=spec.heads, kv_heads=spec.kv_heads,
                             intermediate=spec.intermediate, max_positions=512, seed=0)
    return save_pretrained(model, tok, d)


def probe_config_dir(spec: ProbeModel, root: Path) -> Path:
    """The probe model's config.json and tokenizer without weights (all the planner reads)."""
    import torch

    from grpokit.tasks.tiny import DEFAULT_CHARS, build_char_tokenizer, build_tiny_model

    d = Path(root) / f"config-{spec.name}"
    if (d / "config.json").is_file():
        return d
    tok = build_char_tokenizer(DEFAULT_CHARS + "".join(chr(0x4E00 + i) for i in range(spec.extra_chars)))
    with torch.device("meta"):
        model = build_tiny_model(tok, hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
                                 kv_heads=spec.kv_heads, intermediate=spec.intermediate, max_positions=512, seed=0)
    d.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def estimate_case(case: ProbeCase, root: Path):
    """The planner's estimate for a validation case (reads config and tokenizer only)."""
    from grpokit.config import load_config
    from grpokit.train.memory import estimate_config

    spec = next(m for m in MODELS if m.name == case.model)
    over = case_overrides(case, probe_config_dir(spec, root), probe_data(root), Path(root) / "unused")
    return estimate_config(load_config(None, over), device="cpu")


def probe_data(root: Path) -> Path:
    from grpokit.tasks.arithmetic import ArithmeticTask

    p = Path(root) / "prompts.jsonl"
    if not p.is_file():
        rows = ArithmeticTask(seed=0, heldout=8).train_rows(512, 1)
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def case_overrides(case: ProbeCase, model_dir: Path, data: Path, run_dir: Path) -> list[str]:
    _register_coin()                     # the overrides name it: registered before a config is built
    kv = {**BASE, "model.path": model_dir, "data.path": data, "train.run_dir": run_dir, **case.overrides}
    if kv.get("lora.enabled"):
        kv.setdefault("optim.lr", 1e-4)
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kv.items()]


def validation_table(root: Path, cases: list[ProbeCase] = CASES, *, steps: int = 2, default_rss: bool = True,
                     say=print, done: dict | None = None, save=None) -> list[dict]:
    """Measure every case in fresh processes and set the planner's estimate beside it.

    `measured_mib`: peak RSS with glibc's mmap threshold fixed (`live`), which follows the peak of
    live memory; `rss_default_mib` (with `default_rss`): peak RSS of a plain run, which adds what
    glibc keeps in its heap after frees. `done`: earlier rows by (model, case), reused while their
    estimate is still the planner's; `save(rows)` is called after every case."""
    from grpokit.config import load_config
    from grpokit.train.memory import estimate_config

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    data = probe_data(root)
    dirs = {m.name: build_probe_model(m, root) for m in MODELS if any(c.model == m.name for c in cases)}
    rows = []
    for i, case in enumerate(cases):
        over = case_overrides(case, dirs[case.model], data, root / f"run{i}")
        if "lora.load_in_4bit=true" in over:
            from grpokit.models.lora import four_bit_unavailable
            why = four_bit_unavailable("cpu")
            if why:
                say(f"skipped ({why}): {case.model} {case.label}")
                continue
        est = estimate_config(load_config(None, over), device="cpu")
        old = (done or {}).get((case.model, case.label))
        row = dict(old) if old and abs(old["estimate_mib"] - est.peak / MiB) < 0.5 else {}
        row.update({"model": case.model, "case": case.label, "estimate_mib": est.peak / MiB,
                    "params_m": est.shape.params / 1e6, "phase": est.peak_phase,
                    "parts": {k: v / MiB for k, v in est.parts.items()}})
        if row.get("measured_mib") is None:
            got = measure(None, over, steps=steps, live=True)
            row.update(measured_mib=got["peak_rss_mib"], seconds=got["seconds"])
        if default_rss and row.get("rss_default_mib") is None:
            row["rss_default_mib"] = measure(None, over, steps=steps)["peak_rss_mib"]
        row["error"] = row["estimate_mib"] / row["measured_mib"] - 1
        if row.get("rss_default_mib"):
            row["error_default"] = row["estimate_mib"] / row["rss_default_mib"] - 1
        say(f"{case.model:7s} {case.label:40s} estimate {row['estimate_mib']:6.0f} MiB  live peak "
            f"{row['measured_mib']:6.0f} MiB ({100 * row['error']:+.1f}%)  plain RSS "
            f"{row.get('rss_default_mib') or 0:6.0f} MiB ({100 * row.get('error_default', 0):+.1f}%)")
        rows.append(row)
        if save is not None:
            save(rows)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| model | params | configuration | estimate (MiB) | measured peak, live memory (MiB) | error | "
           "peak RSS of a plain run (MiB) | error | estimated peak phase |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r.get("rss_default_mib")
        dv = f"{d:.0f} | {100 * (r['estimate_mib'] / d - 1):+.1f}%" if d else "– | –"
        out.append(f"| {r['model']} | {r['params_m']:.1f} M | {r['case']} | {r['estimate_mib']:.0f} | "
                   f"{r['measured_mib']:.0f} | {100 * r['error']:+.1f}% | {dv} | {r['phase']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpokit.train.memory_probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="(internal) run steps in this process and print the peaks as JSON")
    r.add_argument("--steps", type=int, default=2)
    r.add_argument("--json", action="store_true")
    r.add_argument("args", nargs="*")
    t = sub.add_parser("table", help="measure the validation cases and print a markdown table")
    t.add_argument("--quick", action="store_true", help="tiny and small models only")
    t.add_argument("--root", default="runs/memory_probe")
    t.add_argument("--out", default=None, help="keep the rows (JSON) here; rows already there are reused "
                   "while their estimate is current")
    t.add_argument("--no-default", action="store_true", help="skip the plain-run RSS measurements")
    t.add_argument("--models", default=None, help="comma-separated probe models to run (default: all)")
    a = p.parse_args(argv)
    if a.cmd == "run":
        import logging
        logging.basicConfig(level=logging.WARNING)
        res = _child([x for x in a.args if "=" not in x], [x for x in a.args if "=" in x], a.steps)
        print(json.dumps(res))
        return 0
    cases = QUICK_CASES if a.quick else CASES
    if a.models:
        cases = [c for c in cases if c.model in a.models.split(",")]
    store = Path(a.out) if a.out else None
    done = {}
    if store is not None and store.is_file():
        done = {(r["model"], r["case"]): r for r in json.loads(store.read_text())}

    def save(rows):
        if store is not None:
            merged = {**done, **{(r["model"], r["case"]): r for r in rows}}
            order = {(c.model, c.label): i for i, c in enumerate(CASES)}
            store.write_text(json.dumps(sorted(merged.values(), key=lambda r: order.get((r["model"], r["case"]), 99)),
                                        indent=2))

    rows = validation_table(Path(a.root), cases, default_rss=not a.no_default, done=done, save=save)
    if store is not None:
        rows = json.loads(store.read_text())
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
