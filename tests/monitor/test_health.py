"""Health rules: each must fire on a synthetic failure and stay quiet on a healthy, noisy run.

Expected numbers are worked out in the comments from the formulas in each rule's docstring.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpokit.monitor import health as H
from grpokit.monitor.health import (
    RULES,
    Alarm,
    EntropyCollapseConfig,
    HealthConfig,
    HealthMonitor,
    KLClimbingConfig,
    LengthExplosionConfig,
    NoSignalConfig,
    RefDriftConfig,
    RewardHackingConfig,
    kendall_tau,
    summarize_alarms,
)

from .synth import healthy_history, series

RULE_NAMES = ["kl_climbing", "length_explosion", "no_signal", "reward_hacking",
              "entropy_collapse", "ref_drift", "rewards_missing"]


def fired(history, config: HealthConfig | None = None) -> dict[str, Alarm]:
    """Every rule run once on the whole history."""
    config = config or HealthConfig()
    out = {}
    for name, rule in RULES.items():
        alarm = rule.fn(history, getattr(config, name))
        if alarm is not None:
            out[name] = alarm
    return out


# ---------------------------------------------------------------------------------------------
# Registry and config


def test_registry_matches_config_fields():
    assert list(RULES) == RULE_NAMES
    assert [f for f in HealthConfig.model_fields if not f.startswith("history_")] == RULE_NAMES
    for name in RULE_NAMES:
        assert RULES[name].params_type is type(getattr(HealthConfig(), name))
        assert "fire" in (RULES[name].fn.__doc__ or "").lower()


def test_every_config_field_has_a_docstring():
    models = [HealthConfig] + [RULES[n].params_type for n in RULE_NAMES]
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_unknown_key_names_it_and_suggests_the_closest():
    with pytest.raises(ValidationError, match=r"unknown key 'kl_climbng'.*did you mean 'kl_climbing'"):
        HealthConfig.model_validate({"kl_climbng": {}})
    with pytest.raises(ValidationError, match=r"unknown key 'windw'.*did you mean 'window'"):
        HealthConfig.model_validate({"kl_climbing": {"windw": 5}})
    with pytest.raises(ValidationError):
        HealthConfig.model_validate({"no_signal": {"action": "explode"}})
    with pytest.raises(ValidationError, match="min_baseline"):
        LengthExplosionConfig(min_baseline=30, baseline_window=20)


def test_config_from_yaml_like_dict():
    cfg = HealthConfig.model_validate(
        {"kl_climbing": {"kl_high": 0.2, "action": "stop"}, "ref_drift": {"action": "off"}}
    )
    assert cfg.kl_climbing.kl_high == 0.2 and cfg.kl_climbing.action == "stop"
    assert cfg.kl_climbing.window == 20  # the rest keeps its defaults
    assert cfg.ref_drift.action == "off"
    assert HealthConfig().kl_climbing.high_steps == 10


def test_kendall_tau_worked_examples():
    assert kendall_tau([1, 2, 3]) == 1.0
    assert kendall_tau([3, 2, 1]) == -1.0
    # pairs (1,3)+ (1,2)+ (3,2)- -> (2 - 1) / 3
    assert kendall_tau([1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([5]) == 0.0


# ---------------------------------------------------------------------------------------------
# kl_climbing


def test_kl_climbing_fires_on_steady_rise():
    # kl_t = 0.02 e^{t/20}, t = 0..29; window = last 20 (t = 10..29), quarters of 5:
    # first median at t=12 -> 0.02 e^0.6 = 0.0364; last median at t=27 -> 0.0771;
    # ratio e^0.75 = 2.12 >= 1.5, tau = 1, 0.0771 >= min_kl 0.05 -> fires, value = kl_29.
    hist = series("kl/ref", [0.02 * math.exp(t / 20) for t in range(30)])
    alarm = H.kl_climbing(hist, KLClimbingConfig())
    assert alarm is not None and alarm.name == "kl_climbing" and alarm.step == 30
    assert alarm.value == pytest.approx(0.02 * math.exp(29 / 20))
    assert alarm.severity == "warn" and "rose steadily" in alarm.message and alarm.advice


def test_kl_climbing_needs_a_full_window():
    hist = series("kl/ref", [0.02 * math.exp(t / 20) for t in range(30)])
    assert H.kl_climbing(hist[-19:], KLClimbingConfig()) is None


@pytest.mark.parametrize("values", [
    [0.002 * math.exp(t / 20) for t in range(30)],  # same shape, below min_kl: early growth
    [0.1 * (1 - math.exp(-t / 40)) for t in range(60, 90)],  # saturating: tau 1, ratio 1.1
    list(0.2 * (1 + 0.1 * np.random.default_rng(1).standard_normal(60))),  # noisy plateau
])
def test_kl_climbing_quiet(values):
    assert H.kl_climbing(series("kl/ref", values), KLClimbingConfig()) is None


def test_kl_climbing_level_test_needs_consecutive_steps_above_kl_high():
    p = KLClimbingConfig(kl_high=0.1, high_steps=5)
    # last 20 = 15 x 0.05 then 0.12s: tau = 75/190 = 0.39 < 0.5, so only the level test can fire
    assert H.kl_climbing(series("kl/ref", [0.05] * 20 + [0.12] * 4), p) is None
    alarm = H.kl_climbing(series("kl/ref", [0.05] * 20 + [0.12] * 5), p)
    assert alarm is not None and "kl_high" in alarm.message and alarm.value == 0.12
    spiky = [0.05] * 20 + [0.12, 0.12, 0.08, 0.12, 0.12]  # one dip under the bound resets it
    assert H.kl_climbing(series("kl/ref", spiky), p) is None
    assert H.kl_climbing(series("kl/ref", [0.05] * 20 + [0.12] * 5), KLClimbingConfig()) is None


def test_kl_climbing_with_a_band_reads_its_unit_and_ignores_a_rise_into_its_lower_half():
    """A short answer learning: per-token KL 0.2 -> 0.6 (three-fold, steady), per-completion KL
    1 -> 2 nats, inside the [1, 10] band: no alarm with the band, the old per-token alarm without.
    A per-completion rise past half the bound (2 -> 6) fires."""
    n = 30
    token = [0.2 + 0.4 * t / (n - 1) for t in range(n)]
    seq_low = [1.0 + 1.0 * t / (n - 1) for t in range(n)]
    seq_high = [2.0 + 4.0 * t / (n - 1) for t in range(n)]
    rows = lambda seq: [{"step": t + 1, "kl/ref": token[t], "kl/ref_seq": seq[t]} for t in range(n)]  # noqa: E731
    band = KLClimbingConfig(kl_high=10.0, unit="sequence")
    assert H.kl_climbing(rows(seq_low), band) is None
    assert H.kl_climbing(rows(seq_low), KLClimbingConfig()) is not None                 # no band: per token
    alarm = H.kl_climbing(rows(seq_high), band)
    assert alarm is not None and "kl/ref_seq" in alarm.message and "past 0.5 of the target bound 10" in alarm.message
    assert alarm.value == pytest.approx(6.0)
    # a token-unit band reads kl/ref with the floor at half its bound
    assert H.kl_climbing(rows(seq_low), KLClimbingConfig(kl_high=2.0, unit="token")) is None   # 0.6 < 1.0
    assert H.kl_climbing(rows(seq_low), KLClimbingConfig(kl_high=1.0, unit="token")) is not None


# ---------------------------------------------------------------------------------------------
# length_explosion


def test_length_explosion_fires_on_a_jump():
    # baseline median 100, last five [100, 100, 250, 250, 250] -> median 250 = 2.5x, +150 tokens
    hist = series("completion/length_mean", [100] * 20 + [250] * 3)
    hist[-1]["completion/clipped_ratio"] = 0.4
    alarm = H.length_explosion(hist, LengthExplosionConfig())
    assert alarm is not None and alarm.value == pytest.approx(2.5)
    assert "40%" in alarm.message and "reward-function hole" in alarm.advice


@pytest.mark.parametrize("values", [
    [100] * 20 + [250] * 2,  # a two-step spike: median of the last five is still 100
    [100] * 9 + [250] * 5,  # only 9 baseline values (< min_baseline 10)
    [3] * 20 + [7] * 5,  # doubled, but only +4 tokens (< min_increase 8)
    [100 + 2 * t for t in range(100)],  # steady growth: the sliding baseline follows it
])
def test_length_explosion_quiet(values):
    assert H.length_explosion(series("completion/length_mean", values), LengthExplosionConfig()) is None


def test_length_explosion_fires_with_exactly_min_baseline():
    hist = series("completion/length_mean", [100] * 10 + [250] * 5)
    assert H.length_explosion(hist, LengthExplosionConfig()) is not None


# ---------------------------------------------------------------------------------------------
# no_signal


def test_no_signal_fires_when_groups_have_equal_rewards():
    hist = series("group/frac_zero_std", [0.3] * 10 + [1.0] * 6 + [0.9] * 4)
    for row in hist:
        row["reward/mean"] = 1.0
    alarm = H.no_signal(hist, NoSignalConfig())  # median of last 10 = 1.0 >= 0.95
    assert alarm is not None and alarm.value == 1.0 and "too easy" in alarm.message
    assert "larger group size G" in alarm.advice


def test_no_signal_fires_on_zero_advantage_std_alone():
    alarm = H.no_signal(series("advantage/std", [0.0] * 10), NoSignalConfig())
    assert alarm is not None and alarm.value == 1.0 and "advantage std" in alarm.message


@pytest.mark.parametrize("key,values", [
    ("advantage/std", [0.0] * 9),  # shorter than the window
    ("group/frac_zero_std", [1.0, 0.5] * 5),  # median 0.75
    ("advantage/std", [0.0] * 4 + [0.8] * 6),  # median 0.8
])
def test_no_signal_quiet(key, values):
    assert H.no_signal(series(key, values), NoSignalConfig()) is None


# ---------------------------------------------------------------------------------------------
# reward_hacking


def _hacking_history(passes):
    # reward_t = 0.2 + 0.6 (t - 1) / 49, t = 1..50; evals at 10, 20, ..., 50.
    hist = series("reward/mean", [0.2 + 0.6 * i / 49 for i in range(50)])
    for k, p in enumerate(passes):
        hist[10 * (k + 1) - 1]["eval/pass@1"] = p
    return hist


def test_reward_hacking_fires_when_reward_rises_and_eval_is_flat():
    # Reward level at eval s = mean of reward over t = s-9..s = 0.2 + 0.6 (s - 5.5) / 49: linear,
    # so the fitted rise over s = 10..50 is exactly 0.6 * 40 / 49 = 0.4898 >= 0.1; pass@1 fit ~0.
    alarm = H.reward_hacking(_hacking_history([0.30, 0.31, 0.29, 0.30, 0.30]), RewardHackingConfig(reward_smooth=10))
    assert alarm is not None and alarm.value == pytest.approx(0.6 * 40 / 49)
    assert "stayed flat" in alarm.message


def test_reward_hacking_fires_when_eval_falls():
    alarm = H.reward_hacking(_hacking_history([0.5, 0.45, 0.4, 0.35, 0.3]), RewardHackingConfig())
    assert alarm is not None and "fell" in alarm.message


@pytest.mark.parametrize("passes", [
    [0.2, 0.3, 0.4, 0.5, 0.6],  # eval rises with the reward
    [0.3, 0.3],  # two eval points only (< min_eval_points 3)
])
def test_reward_hacking_quiet(passes):
    assert H.reward_hacking(_hacking_history(passes), RewardHackingConfig()) is None


def test_reward_hacking_follows_sampled_held_out_accuracy_when_logged():
    # greedy pass@1 flat while the sampled held-out accuracy rises with the (sampled) training
    # reward: a policy sharpening on answers it already got right greedily, not a hack
    hist = _hacking_history([0.30, 0.31, 0.29, 0.30, 0.30])
    for k, m in enumerate([0.2, 0.3, 0.4, 0.5, 0.6]):
        hist[10 * (k + 1) - 1]["eval/mean@k"] = m
    assert H.held_out_metric(hist) == "eval/mean@k"
    assert H.reward_hacking(hist, RewardHackingConfig()) is None
    # the sampled held-out accuracy falling while the reward rises: fires, and says which metric
    for k, m in enumerate([0.5, 0.45, 0.4, 0.35, 0.3]):
        hist[10 * (k + 1) - 1]["eval/mean@k"] = m
    alarm = H.reward_hacking(hist, RewardHackingConfig())
    assert alarm is not None and "held-out mean@k fell" in alarm.message


def test_reward_hacking_ignores_eval_before_any_reward():
    # An eval at step 0 (before training) has no reward level, so only 2 usable points remain.
    hist = [{"step": 0, "eval/pass@1": 0.9}] + _hacking_history([0.3, 0.3])
    assert H.reward_hacking(hist, RewardHackingConfig()) is None


def test_reward_hacking_fires_on_checker_disagreement():
    p = RewardHackingConfig()
    alarm = H.reward_hacking(series("reward/checker_disagreement", [0.01, 0.3, 0.3, 0.3]), p)
    assert alarm is not None and alarm.value == pytest.approx(0.3) and "30%" in alarm.message
    assert H.reward_hacking(series("reward/checker_disagreement", [0.3, 0.3]), p) is None
    assert H.reward_hacking(series("reward/checker_disagreement", [0.05] * 10), p) is None


# ---------------------------------------------------------------------------------------------
# entropy_collapse


def test_entropy_collapse_fires_relative_to_early_value():
    # early median 1.0; last five [0.09 .. 0.05] -> median 0.07 < 0.1 * 1.0
    values = [1.0] * 10 + list(np.linspace(0.9, 0.1, 9)) + [0.09, 0.08, 0.07, 0.06, 0.05]
    alarm = H.entropy_collapse(series("policy/entropy", values), EntropyCollapseConfig())
    assert alarm is not None and alarm.value == pytest.approx(0.07) and "7%" in alarm.message


def test_entropy_collapse_fires_below_floor():
    alarm = H.entropy_collapse(series("policy/entropy", [0.005] * 5), EntropyCollapseConfig())
    assert alarm is not None and "floor" in alarm.message


def test_entropy_collapse_advice_raises_the_group_size_first_and_warns_off_the_temperature():
    """For more exploration raise G, not the temperature (docs/metrics.md): the advice names the
    group size before anything else and mentions the temperature only to warn against it."""
    alarm = H.entropy_collapse(series("policy/entropy", [0.005] * 5), EntropyCollapseConfig())
    advice = alarm.advice.lower()
    first = advice.index("group size g first")
    assert all(first < advice.index(later) for later in ("clip", "learning rate", "entropy bonus", "temperature"))
    assert "do not raise the sampling temperature blindly" in advice
    assert advice.count("raise the sampling temperature") == 1        # only in that warning
    assert "rollout.group_size" in advice


@pytest.mark.parametrize("values", [
    [1.0] * 10 + [0.2] * 5,  # fell to 20% of early: a decrease, not a collapse
    [0.005] * 4,  # too few values for the floor test
    [1.0] * 5 + [0.05] * 5,  # 10 values: not enough for early (10) + recent (5)
])
def test_entropy_collapse_quiet(values):
    assert H.entropy_collapse(series("policy/entropy", values), EntropyCollapseConfig()) is None


# ---------------------------------------------------------------------------------------------
# ref_drift


def test_ref_drift():
    p = RefDriftConfig(action="stop")
    alarm = H.ref_drift(series("ref/integrity_drift", [0.0, 0.2]), p)
    assert alarm is not None and alarm.value == 0.2 and alarm.severity == "stop"
    assert H.ref_drift(series("ref/integrity_drift", [0.2, 5e-5]), p) is None  # latest counts
    assert H.ref_drift(series("ref/integrity_drift", [5e-5]), p) is None  # within 1e-4
    # the probe runs every few steps: a bad reading fires on its own step only
    assert H.ref_drift(series("ref/integrity_drift", [0.2]) + [{"step": 2}], p) is None
    assert H.ref_drift([], p) is None
    nan = H.ref_drift(series("ref/integrity_drift", [1e-4, math.nan]), p)
    assert nan is not None and "nan" in nan.message


# ---------------------------------------------------------------------------------------------
# Healthy runs stay quiet


def test_healthy_run_fires_nothing_at_any_step():
    hist = healthy_history(300)
    mon = HealthMonitor(HealthConfig(), None, print_fn=lambda s: pytest.fail(s))
    for row in hist:
        assert mon.update(row["step"], row) == []
    assert mon.summary() == "Healthy: no alarm fired in 300 steps."


@pytest.mark.parametrize("seed", range(5))
def test_short_noisy_run_fires_nothing(seed):
    # 20 steps with 30% noise on everything, KL set near the controller's bound
    rng = np.random.default_rng(seed)
    hist = healthy_history(20, seed=seed, eval_every=5)
    for row in hist:
        for k in ("kl/ref", "completion/length_mean", "advantage/std", "policy/entropy"):
            row[k] *= 1 + 0.3 * rng.standard_normal()
        row["kl/ref"] = abs(0.08 * (1 + 0.3 * rng.standard_normal()))
    cfg = HealthConfig.model_validate({"kl_climbing": {"kl_high": 0.15}})
    for t in range(1, 21):
        assert fired(hist[:t], cfg) == {}


finite_noise = st.floats(-1.0, 1.0)
glitch = st.sampled_from([None, math.nan, math.inf, -math.inf])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    levels=st.tuples(st.floats(1e-3, 1.0), st.floats(1.0, 500.0), st.floats(0.1, 1.0),
                     st.floats(0.0, 0.7), st.floats(0.0, 0.5), st.floats(0.05, 2.0)),
    noise=st.lists(finite_noise, min_size=360, max_size=360),
    glitches=st.lists(st.tuples(st.integers(0, 59), st.integers(0, 5), glitch), max_size=20),
)
def test_property_bounded_stationary_noise_never_fires(n, levels, noise, glitches):
    """Metrics within ±19% of a constant level (±4.9% for the reward) can never fire a rule:
    any ratio of two medians is at most 1.19 / 0.81 = 1.47 (< rise_factor 1.5, < length factor 2,
    > entropy min_fraction 0.1); KL stays under kl_high = 2; frac_zero_std ≤ 0.7 · 1.19 < 0.95;
    the fitted reward rise over ≤ 5 evenly spaced evals is at most 1.2 × its range
    = 1.2 · 2 · 0.049 · 0.5 = 0.059 < 0.1; disagreement ≤ 0.06 < 0.1; drift ≤ 5e-5 < 1e-4.
    NaN, inf and missing values are skipped and never crash a rule."""
    keys = ["kl/ref", "completion/length_mean", "advantage/std", "group/frac_zero_std",
            "reward/mean", "policy/entropy"]
    rel = [0.19, 0.19, 0.19, 0.19, 0.049, 0.19]
    noise = np.asarray(noise).reshape(60, 6)
    hist = []
    for t in range(n):
        row = {"step": t + 1}
        for j, (key, level) in enumerate(zip(keys, levels)):
            row[key] = level * (1 + rel[j] * noise[t, j])
        if t % 5 == 4:
            row["eval/pass@1"] = 0.5 + 0.2 * noise[t, 0]
        row["reward/checker_disagreement"] = 0.05 * (1 + 0.19 * noise[t, 1])
        row["ref/integrity_drift"] = 5e-5 * abs(noise[t, 2])
        hist.append(row)
    for t, j, bad in glitches:
        if t < n and j < len(keys):
            if bad is None:
                hist[t].pop(keys[j], None)
            else:
                hist[t][keys[j]] = bad
    cfg = HealthConfig.model_validate({"kl_climbing": {"min_kl": 0.0, "kl_high": 2.0}})
    assert fired(hist, cfg) == {}


# ---------------------------------------------------------------------------------------------
# HealthMonitor


def _kl_high_stream(n):
    """KL 0.05 for 10 steps then 0.3: with kl_high=0.2, high_steps=5 the level test fires from
    step 15 on."""
    return [{"step": t, "kl/ref": 0.05 if t <= 10 else 0.3, "loss/total": 1.0} for t in range(1, n + 1)]


def test_monitor_prints_each_alarm_once_and_logs_every_firing(tmp_path):
    printed = []
    cfg = HealthConfig.model_validate({"kl_climbing": {"kl_high": 0.2, "high_steps": 5}})
    mon = HealthMonitor(cfg, tmp_path, print_fn=printed.append)
    results = [mon.update(r["step"], r) for r in _kl_high_stream(20)]
    assert [len(r) for r in results] == [0] * 14 + [1] * 6  # steps 15..20
    assert len(printed) == 1
    assert "kl_climbing" in printed[0] and "advice:" in printed[0] and "step 15" in printed[0]
    lines = (tmp_path / "alarms.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(15, 21))
    assert set(rows[0]) == {"name", "step", "severity", "message", "advice", "value"}
    assert Alarm.from_dict(rows[0]) == results[14][0]
    assert not mon.should_stop
    assert "kl_climbing (warn) fired 6 times, from step 15 to step 20" in mon.summary()


def test_monitor_stop_action(tmp_path):
    cfg = HealthConfig.model_validate({"no_signal": {"action": "stop", "window": 3}})
    mon = HealthMonitor(cfg, tmp_path, print_fn=lambda s: None)
    for t in (1, 2):
        mon.update(t, {"advantage/std": 0.0})
        assert not mon.should_stop
    (alarm,) = mon.update(3, {"advantage/std": 0.0})
    assert alarm.severity == "stop" and mon.should_stop
    mon.update(4, {"advantage/std": 1.0})
    assert mon.should_stop  # sticky
    assert "asked to stop by: no_signal" in mon.summary()


def test_monitor_off_action_disables_the_rule(tmp_path):
    mon = HealthMonitor(HealthConfig.model_validate({"ref_drift": {"action": "off"}}), tmp_path)
    assert mon.update(1, {"ref/integrity_drift": 5.0}) == []
    assert not (tmp_path / "alarms.jsonl").exists()


def test_monitor_keeps_only_rule_metrics_and_drops_replayed_steps():
    mon = HealthMonitor(HealthConfig(), None, print_fn=lambda s: None)
    for t in range(1, 6):
        mon.update(t, {"kl/ref": 0.01 * t, "time/step": 3.0, "note": "x", "flag": True})
    assert mon.history[0] == {"step": 1, "kl/ref": 0.01}
    mon.update(3, {"kl/ref": 0.5})  # a rollback to step 3: steps 3..5 are replaced
    assert [e["step"] for e in mon.history] == [1, 2, 3]
    assert mon.history[-1]["kl/ref"] == 0.5
    assert mon.summary() == "Healthy: no alarm fired in 3 steps."


def test_monitor_history_keeps_head_and_recent_tail():
    cfg = HealthConfig(history_head=3, history_limit=100)
    mon = HealthMonitor(cfg, None, print_fn=lambda s: None)
    for t in range(1, 301):
        mon.update(t, {"policy/entropy": 1.0})
    assert [e["step"] for e in mon.history] == [1, 2, 3] + list(range(201, 301))
    assert mon.summary() == "Healthy: no alarm fired in 300 steps."


def test_state_round_trip_resumes_identically(tmp_path):
    cfg = HealthConfig.model_validate({"kl_climbing": {"kl_high": 0.2, "high_steps": 5}})
    stream = _kl_high_stream(40)
    printed_a, printed_b = [], []
    a = HealthMonitor(cfg, tmp_path / "a", print_fn=printed_a.append)
    for r in stream[:20]:
        a.update(r["step"], r)
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints store it as JSON
    b = HealthMonitor(cfg, tmp_path / "b", print_fn=printed_b.append)
    b.load_state_dict(state)
    for r in stream[20:]:
        assert a.update(r["step"], r) == b.update(r["step"], r)
    assert printed_b == []  # kl_climbing was already announced before the checkpoint
    assert a.summary() == b.summary() and "26 times" in b.summary()
    assert a.state_dict() == b.state_dict()


def test_resume_drops_alarm_rows_logged_after_the_checkpoint(tmp_path):
    cfg = HealthConfig.model_validate({"kl_climbing": {"kl_high": 0.2, "high_steps": 5}})
    stream = _kl_high_stream(30)
    a = HealthMonitor(cfg, tmp_path, print_fn=lambda s: None)
    for r in stream[:20]:
        a.update(r["step"], r)
    state = a.state_dict()  # checkpoint at step 20 (alarms at 15..20)
    for r in stream[20:25]:
        a.update(r["step"], r)  # then the run dies at step 25
    b = HealthMonitor(cfg, tmp_path, print_fn=lambda s: None)
    b.load_state_dict(state)
    steps = [json.loads(line)["step"] for line in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert steps == list(range(15, 21))
    for r in stream[20:]:
        b.update(r["step"], r)
    steps = [json.loads(line)["step"] for line in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert steps == list(range(15, 31))


def test_summarize_alarms_plain_words():
    assert summarize_alarms([], n_steps=12) == "Healthy: no alarm fired in 12 steps."
    rows = [
        {"name": "ref_drift", "step": 9, "severity": "stop", "message": "M.", "advice": "A.",
         "value": 0.3},
        Alarm("no_signal", 3, "warn", "N.", "B.", 1.0),
    ]
    text = summarize_alarms(rows)
    assert text.splitlines() == [
        "2 alarms fired. Training was asked to stop by: ref_drift.",
        "- no_signal (warn) fired once, at step 3. N. Advice: B.",
        "- ref_drift (stop) fired once, at step 9. M. Advice: A.",
    ]
