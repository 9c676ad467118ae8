"""Shared builders for tests: a tiny seeded model directory and arithmetic prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpokit.config import load_config
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained


def unchecked_kernels(module):
    """A native-kernel module's entry points (`module._bind` over `module.SOURCE`) as built, without
    the load-time check, which would hide a wrong kernel by falling back to PyTorch; None where they
    cannot be built here (no compiler, or a CPU the kernels do not support)."""
    import ctypes

    from grpokit import cbuild
    try:
        return module._bind(ctypes.CDLL(str(cbuild.build(module.SOURCE))))
    except (RuntimeError, OSError):
        return None


def op_calls(fn, op: str) -> int:
    """How many times `fn()` ran operator `op` (the profiler's count, e.g. "aten::addmm_")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == op)


def tiny_model_dir(path: Path, *, arch: str = "qwen2", hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, arch=arch, hidden=hidden, layers=layers, heads=2, intermediate=64,
                             max_positions=64, seed=seed)
    return save_pretrained(model, tok, path)


def arithmetic_files(path: Path, n_train: int = 256, seed: int = 0) -> tuple[Path, Path]:
    task = ArithmeticTask(seed=seed, heldout=32)
    path.mkdir(parents=True, exist_ok=True)
    train, held = path / "train.jsonl", path / "heldout.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in task.train_rows(n_train, seed)))
    held.write_text("".join(json.dumps(r) + "\n" for r in task.heldout_rows()))
    return train, held


def tiny_run_inputs(root: Path, n_train: int = 64) -> tuple[Path, Path, Path, Path]:
    """(root, model dir, train file, held-out file) for a module's tiny training runs."""
    train, held = arithmetic_files(root / "data", n_train=n_train)
    return root, tiny_model_dir(root / "model"), train, held


def small_overrides(model_dir: Path, train: Path, run_dir: Path, **extra) -> list[str]:
    base = {
        "model.path": model_dir, "data.path": train, "train.run_dir": run_dir,
        "rollout.group_size": 4, "rollout.batch_size": 16, "rollout.max_new_tokens": 4,
        "rollout.temperature": 1.0, "optim.lr": 1e-3, "optim.micro_batch_size": 16,
        "train.steps": 2, "train.progress": False, "monitor.sinks": "[jsonl]", "train.sample_every": 0,
        "rewards": "[{name: exact_match}]",
        "data.eval_split": 0,   # no held-out split carved: these runs test other things (the split: test_heldout.py)
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def varied_trainer(setup: tuple[Path, Path, Path, Path], name: str, **extra):
    """A trainer over `setup` (tiny_run_inputs) writing to `root/name`: lr 1e-2 on the `test_varied`
    reward (so groups carry signal), torch seeded, no health monitor."""
    from grpokit.train import build_trainer

    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / name, **{
        "optim.lr": 1e-2, "rewards": "[{name: test_varied}]", **extra}))
    torch.manual_seed(0)
    return build_trainer(cfg, health=False)


def greedy_outputs(engine, trainer, n: int = 6):
    """Greedy completions and sampler log-probs of `engine` on the first `n` training prompts."""
    from grpokit.rollout.base import SamplingParams

    ids = [trainer.encoder.encode(trainer.dataset[i]["prompt"]) for i in range(n)]
    out = engine.generate(ids, SamplingParams(n=1, max_new_tokens=6, temperature=0.0))
    return out.completion_ids, out.sampler_logprobs


from grpokit.rewards import REGISTRY, register  # noqa: E402

if "test_varied" not in REGISTRY:
    @register("test_varied")
    def test_varied(prompts, completions, **columns):
        """A reward with variance even for a random model: digits in the completion, mod 3."""
        return [float(sum(ch.isdigit() for ch in c) % 3) for c in completions]

if "test_text_length" not in REGISTRY:
    @register("test_text_length")
    def test_text_length(prompts, completions, **columns):
        """A reward with variance for any random model and vocabulary: the completion's length in
        characters, mod 5 (a digit-based reward is constant for a model that writes no digits)."""
        return [float(len(c) % 5) for c in completions]

if "test_no_reward" not in REGISTRY:
    @register("test_no_reward")
    def test_no_reward(prompts, completions, **columns):
        """A reward that scores nothing (None for every completion): the health monitor's
        `rewards_missing` alarm must fire on every step of a run that uses it."""
        return [None] * len(completions)


def alarm_names(run_dir) -> set[str]:
    """The names of the alarms a run's health monitor wrote (RUN_DIR/alarms.jsonl)."""
    path = Path(run_dir) / "alarms.jsonl"
    return {json.loads(line)["name"] for line in path.read_text().splitlines()} if path.is_file() else set()
