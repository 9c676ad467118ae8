"""How the trainer feeds the health monitor: the thresholds it fills in from the rest of the config,
the KL it logs when the KL is in the reward, and that every metric it logs is documented."""

import json
import re
from pathlib import Path

import pytest

from grpokit.config import load_config
from grpokit.train import build_health, build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _health(tmp_path, *over):
    cfg = load_config(None, [f"train.run_dir={tmp_path}", *over])
    return build_health(cfg).config


@pytest.mark.parametrize("over, kl_high", [
    ([], 10.0),                                                             # adaptive: target_high
    (["health.kl_climbing.action=stop"], 10.0),                             # another field set
    (["health.kl_climbing.kl_high=0.5"], 0.5),                              # set by the user
    (["algorithm.kl.target_high=30"], 30.0),
    (["algorithm.kl.controller=ziegler", "algorithm.kl.controller_args={target: 0.2}"], 0.2),
    (["algorithm.kl.controller=fixed"], None),                              # no target range
    (["algorithm.kl.controller=schedule"], None),
    (["algorithm.kl.controller=warmup", "algorithm.kl.controller_args={steps: 5}"], None),
    (["algorithm.kl.beta=0"], None),                                        # no reference
    (["algorithm.kl.controller=warmup",                                     # a warm-up over adaptive
      "algorithm.kl.controller_args={steps: 5, inner: {kind: adaptive, beta: 0.02, low: 0.01, high: 0.2}}"], 0.2),
])
def test_kl_high_comes_from_the_controllers_target_unless_set(tmp_path, over, kl_high):
    h = _health(tmp_path, *over)
    assert h.kl_climbing.kl_high == kl_high
    if kl_high is not None and "health.kl_climbing.kl_high=0.5" not in over:
        assert h.kl_climbing.unit == "sequence"                             # the controller's unit
    assert _health(tmp_path, "algorithm.kl.target_unit=token", "algorithm.kl.target_low=0.01").kl_climbing.unit == "token"
    if "health.kl_climbing.action=stop" in over:
        assert h.kl_climbing.action == "stop"


@pytest.mark.parametrize("over, tolerance", [
    (["guard.ref_tolerance=0.001"], 0.001),
    (["guard.ref_tolerance=0.001", "health.ref_drift.action=stop"], 0.001),  # another field set
    (["guard.ref_tolerance=0.001", "health.ref_drift.tolerance=0.5"], 0.5),
])
def test_ref_drift_tolerance_comes_from_the_guard_unless_set(tmp_path, over, tolerance):
    assert _health(tmp_path, *over).ref_drift.tolerance == tolerance


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("wiring"))[:3]


def test_kl_in_the_reward_is_logged_as_kl_ref(setup):
    """With algorithm.kl.in_reward the loss has no KL term; kl/ref is the token mean of the k1 the
    reward is charged, so the kl_climbing alarm has something to read."""
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "in_reward", **{
        "rewards": "[{name: test_varied}]", "algorithm.kl.beta": 0.05, "algorithm.kl.controller": "fixed",
        "algorithm.kl.in_reward": True, "train.steps": 2}))
    tr = build_trainer(cfg)
    rows = []
    tr.train(progress=lambda step, m: rows.append(m))
    assert [("kl/ref" in m) for m in rows] == [True, True]
    assert rows[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)      # the policy is the reference at step 1
    assert rows[1]["kl/ref"] != 0.0 and abs(rows[1]["kl/ref"]) < 10
    assert "kl/ref" in tr.health.history[-1]


def _documented_metrics() -> set[str]:
    """The names in docs/metrics.md's metric table (the one table whose header starts `| metric |`)."""
    text = DOCS.read_text()
    tables = re.findall(r"^\| metric \|.*?(?=^\s*$)", text, flags=re.MULTILINE | re.DOTALL)
    assert len(tables) == 1, "docs/metrics.md must have one metric table"
    return set(re.findall(r"^\| `([^`]+)`", tables[0], flags=re.MULTILINE))


def test_every_logged_metric_is_in_the_one_documented_table(setup):
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "documented", **{
        "rewards": "[{name: test_varied}, {name: exact_match}]", "algorithm.kl.beta": 0.05,
        "algorithm.kl.ref_cache": 64, "train.steps": 1, "guard.ref_check_every": 1}))
    tr = build_trainer(cfg)
    tr.train()
    row = tr.run.sink.path.read_text().splitlines()[-1]
    logged = set(json.loads(row)) - {"step", "time"}
    names = {re.sub(r"^time/reward_(test_varied|exact_match)$", "time/reward_<fn>",
                    re.sub(r"^reward/(test_varied|exact_match)/", "reward/<fn>/", k)) for k in logged}
    assert names <= _documented_metrics(), sorted(names - _documented_metrics())
