"""The `code` preset end to end: a tiny model warm-started to write one-line Python programs is
trained for two steps with the preset's reward wiring, every completion scored by running the
prompt's unit tests in the sandbox (`code_tests`)."""

import json
import math

import pytest

from grpokit.config import load_config
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained
from grpokit.train import build_trainer
from grpokit.train.sft import sft


def _program(k: int) -> str:
    return f"```\nf=lambda x:x+{k}\n```"


def _tests(k: int) -> str:
    # the first test passes for any program of the taught form, the other two only with the right k:
    # a completion in the right form scores 1/3 or 1, anything else 0 (all judged by the trainer)
    return f"assert f(1) - f(0) == 1\nassert f(0) == {k}\nassert f(2) == {k + 2}\n"


@pytest.mark.slow
def test_the_code_preset_trains_through_the_sandbox(tmp_path):
    tok = build_char_tokenizer("`\nf=lambdax:+()0123456789 ")
    model = build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, max_positions=64, seed=0)
    # warm start: the program's form (a random model never writes a fenced block); which k goes
    # with which prompt is left to chance, so groups get different scores
    sft(model, tok, lambda n, rng: [(f"f(x)=x+{k}:", _program(k)) for k in (rng.randint(1, 9) for _ in range(n))],
        steps=40, batch_size=16, lr=2e-2, warmup=5)
    model_dir = save_pretrained(model, tok, tmp_path / "model")
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"f(x)=x+{k}:", "tests": _tests(k)}) + "\n" for k in range(1, 10)))

    over = {
        "model.path": model_dir, "data.path": data, "train.run_dir": tmp_path / "run",
        "rollout.group_size": 4, "rollout.batch_size": 16, "rollout.max_new_tokens": 24,
        "optim.micro_batch_size": 16, "train.steps": 2, "train.progress": False,
        "monitor.sinks": "[jsonl]", "train.sample_every": 0,
    }
    cfg = load_config("code", [f"{k}={v}" for k, v in over.items()])
    assert [r.name for r in cfg.rewards] == ["code_tests"]            # the preset's reward, not overridden
    tr = build_trainer(cfg, health=False)
    tr.train()

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("loss/total", "loss/policy", "kl/ref", "reward/mean", "reward/code_tests/mean", "advantage/std"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["reward/code_tests/errors"] == 0 and r["reward/code_tests/none_frac"] == 0   # the sandbox ran
    # programs passed unit tests in the sandbox: the mean reward is above 0, and its different scores
    # within groups gave the update something to learn from
    assert max(r["reward/code_tests/mean"] for r in rows) > 0
    assert max(r["advantage/std"] for r in rows) > 0 and max(r["optim/grad_norm"] for r in rows) > 0, rows
