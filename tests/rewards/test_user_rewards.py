"""A user's own reward named in config by import reference (`module:function`, `module.function`,
`path/to/file.py:function`): imported and checked when the config is built, scored like a
built-in, and one line for each way the reference can be wrong."""

from __future__ import annotations

import json
import sys

import pytest

from grpokit.cli import main
from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.rewards import REGISTRY, RewardSet, required_columns, resolve

MODULE = '''
def overlap(completions, answer, **kwargs):            # TRL's signature
    return [len(set(c) & set(a)) / len(set(a)) for c, a in zip(completions, answer)]

def shorter(prompts, completions, limit=3, **columns):  # grpokit's
    return [float(len(c) <= limit) for c in completions]

THRESHOLD = 0.5

class Scorer:
    pass
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A current directory holding `my_rewards.py` and `lib/extra.py`; the registry and the
    imported modules are as before afterwards."""
    (tmp_path / "my_rewards.py").write_text(MODULE)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "extra.py").write_text("def has_seven(prompts, completions, **columns):\n"
                                               "    return [float('7' in c) for c in completions]\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    registry = dict(REGISTRY)
    yield tmp_path
    REGISTRY.clear()
    REGISTRY.update(registry)
    # Forget the user modules imported from this directory only: dropping everything first imported
    # during the test would also drop library modules (torch.distributed's register native ops once
    # per process, and a re-import fails for every later test).
    for name, mod in list(sys.modules.items()):
        if str(getattr(mod, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _score(rewards_override: str, completions: list[str], answers: list[str]):
    cfg = load_config("grpo", [rewards_override])
    rs = RewardSet.from_specs([s.model_dump() for s in cfg.rewards])
    out = rs.score(["p"] * len(completions), completions, {"answer": answers})
    return cfg, out


def test_module_function_dotted_and_file_references_score_like_builtins(workdir):
    comps, answers = ["123", "9", "1234567"], ["321", "12", "7"]
    cfg, out = _score("rewards=[{name: 'my_rewards:overlap'}, {name: my_rewards.shorter, args: {limit: 4}}, "
                      "{name: 'lib/extra.py:has_seven', weight: 2}]", comps, answers)
    assert [s.name for s in cfg.rewards] == ["my_rewards:overlap", "my_rewards.shorter", "lib/extra.py:has_seven"]
    # worked out by hand: overlap = shared characters / characters of the answer
    assert out.per_fn["my_rewards:overlap"] == [1.0, 0.0, 1.0]
    assert out.per_fn["my_rewards.shorter"] == [1.0, 1.0, 0.0]        # limit 4 from the config args
    assert out.per_fn["lib/extra.py:has_seven"] == [0.0, 0.0, 1.0]
    assert out.total == [2.0, 1.0, 3.0]
    assert out.metrics["reward/my_rewards:overlap/mean"] == pytest.approx(2 / 3)


def test_a_reference_imports_its_module_once_and_keeps_resolving_to_the_same_function(workdir):
    first = resolve("my_rewards:overlap")
    assert resolve("my_rewards:overlap") is first
    assert resolve("lib/extra.py:has_seven") is resolve("lib/extra.py:has_seven")
    assert REGISTRY["my_rewards:overlap"] is first


def test_required_columns_come_from_the_signature(workdir):
    assert required_columns(resolve("my_rewards:overlap")) == ["answer"]
    assert required_columns(resolve("my_rewards:shorter")) == []
    assert required_columns(resolve("math_accuracy"), {"answer_column": "gold"}) == ["gold"]
    assert required_columns(resolve("math_accuracy")) == ["answer"]


@pytest.mark.parametrize("name, fragment", [
    ("my_reward:overlap", "no module named 'my_reward' (looked in"),
    ("my_rewards:overlpa", "my_rewards has no attribute 'overlpa'; did you mean 'overlap'?"),
    ("my_rewards:THRESHOLD", "THRESHOLD is a float, not a reward function"),
    ("my_rewards:Scorer", "Scorer is a type, not a reward function"),
    ("lib/missing.py:f", "file not found: lib/missing.py"),
    ("broken.py:f", "importing broken.py failed: SyntaxError"),
    ("raises.py:f", "importing raises.py failed: RuntimeError: no GPU here"),
    ("math_acuracy.x", "not a registered reward either; did you mean 'math_accuracy'?"),
    ("my_rewards:", "an import reference is MODULE:FUNCTION or path/to/file.py:FUNCTION"),
])
def test_a_wrong_reference_is_one_line_at_config_build(workdir, name, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("grpo", [f"rewards=[{{name: '{name}'}}]"])
    msg = str(err.value)
    assert msg.startswith("config key 'rewards.0.name': ") and fragment in msg and "\n" not in msg, msg
    assert name not in REGISTRY


def test_a_reference_trains_from_the_cli_without_a_launcher(workdir, capsys):
    """`grpokit train ... rewards=[{name: my_rewards:overlap}]`: the metric carries the reference,
    the run's config.yaml names it, and a later process (eval) resolves it again."""
    from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir

    model = tiny_model_dir(workdir / "model")
    train, held = arithmetic_files(workdir / "data", n_train=16)
    run = workdir / "run"
    over = small_overrides(model, train, run, **{"train.steps": 1, "rewards": "[{name: 'my_rewards:overlap'}]"})
    assert main(["train", "grpo", *over]) == 0
    [row] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= row["reward/my_rewards:overlap/mean"] <= 1.0 and row["reward/my_rewards:overlap/errors"] == 0
    assert "name: my_rewards:overlap" in (run / "config.yaml").read_text()
    REGISTRY.pop("my_rewards:overlap")                          # as in a new process
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--data", str(held), "--config", str(run / "config.yaml"),
                 "rollout.max_new_tokens=4", "data.eval_size=4"]) == 0
    assert '"eval/pass@1"' in capsys.readouterr().out
