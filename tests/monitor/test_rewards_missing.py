"""The `rewards_missing` alarm: a step whose completions mostly have no reward is not healthy."""

from __future__ import annotations

import json

import pytest

from grpokit.monitor.health import HealthConfig, HealthMonitor, RewardsMissingConfig, rewards_missing


def _step(step: int, missing: float, **per_reward: float) -> dict:
    return {"step": step, "reward/total_nan_frac": missing,
            **{f"reward/{name}/none_frac": v for name, v in per_reward.items()}}


@pytest.mark.parametrize("missing, fires", [(0.0, False), (0.49, False), (0.5, True), (1.0, True)])
def test_fires_from_the_threshold_on(missing, fires):
    alarm = rewards_missing([_step(1, missing, math_accuracy=missing)], RewardsMissingConfig())
    assert (alarm is not None) == fires
    if fires:
        assert alarm.value == missing and alarm.step == 1 and "math_accuracy" in alarm.message


def test_names_the_rewards_that_scored_none_most_first():
    alarm = rewards_missing([_step(3, 0.75, fmt=0.25, **{"my_rewards:score": 0.75}, other=0.0)],
                           RewardsMissingConfig(max_missing=0.6))
    assert "75% of this step's completions have no reward" in alarm.message
    assert "my_rewards:score 75%, fmt 25%" in alarm.message and "other" not in alarm.message


def test_the_monitor_keeps_every_rewards_none_fraction_and_the_verdict_is_not_healthy(tmp_path):
    mon = HealthMonitor(HealthConfig(), tmp_path, print_fn=lambda s: None)
    mon.update(1, {**_step(1, 0.0, exact_match=0.0), "reward/mean": 0.5})
    assert mon.summary().startswith("Healthy")
    fired = mon.update(2, {**_step(2, 1.0, exact_match=1.0), "reward/mean": float("nan")})
    assert [a.name for a in fired] == ["rewards_missing"] and "exact_match 100%" in fired[0].message
    assert mon.history[-1]["reward/exact_match/none_frac"] == 1.0
    assert not mon.summary().startswith("Healthy") and "rewards_missing" in mon.summary()
    [row] = [json.loads(x) for x in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert row["name"] == "rewards_missing" and row["step"] == 2


def test_off_and_stop_like_every_alarm(tmp_path):
    off = HealthMonitor(HealthConfig(rewards_missing={"action": "off"}), None, print_fn=lambda s: None)
    assert off.update(1, _step(1, 1.0)) == []
    stop = HealthMonitor(HealthConfig(rewards_missing={"action": "stop"}), None, print_fn=lambda s: None)
    stop.update(1, _step(1, 1.0))
    assert stop.should_stop


def test_a_training_run_whose_reward_scores_none_is_not_healthy(tmp_path, caplog):
    """Two real steps with a reward that has no answer for most samples: the alarm fires at each
    step and the run's health summary says so."""
    from grpokit.config import load_config
    from grpokit.rewards import REGISTRY, register
    from grpokit.train import build_trainer
    from tests.fixtures import small_overrides, tiny_run_inputs

    root, model, train, _ = tiny_run_inputs(tmp_path, n_train=16)

    def mostly_unscorable(prompts, completions, **columns):
        return [1.0 if i % 4 == 0 else None for i in range(len(completions))]

    register("test_mostly_unscorable")(mostly_unscorable)
    try:
        cfg = load_config(None, small_overrides(model, train, root / "run", **{
            "rewards": "[{name: test_mostly_unscorable}]", "train.check_rewards": False}))
        tr = build_trainer(cfg)
        with caplog.at_level("INFO", logger="grpokit.train"):
            tr.train()
    finally:
        REGISTRY.pop("test_mostly_unscorable")
    alarms = [json.loads(x) for x in (root / "run" / "alarms.jsonl").read_text().splitlines()]
    assert [(a["name"], a["step"]) for a in alarms] == [("rewards_missing", 1), ("rewards_missing", 2)]
    assert alarms[0]["value"] == pytest.approx(0.75)
    assert "health: 1 alarm fired in 2 steps" in caplog.text and "Healthy" not in caplog.text
