"""Tests for grpokit.algo.control: Ziegler worked examples (Ziegler et al. 2019 §2.2), band
controller, warm-up (cosine, linear, step) and late-training schedules, composition, state
round-trips, bad input."""

import math

import pytest

from grpokit.algo.control import (
    CONTROLLERS,
    AdaptiveKL,
    FixedKL,
    KLController,
    ScheduleKL,
    WarmupKL,
    ZieglerKL,
    build_controller,
)


def test_fixed():
    c = build_controller("fixed", beta=0.04)
    assert c.beta == 0.04 and c.step(123.0) == 0.04 and c.beta == 0.04


# Ziegler's rule, β = 0.1, target = 6 (docs/algorithms.md §5):
#   KL 12: e = clip(12/6 − 1) = 0.2. Code K = 512/10000: 0.1·(1 + 0.0512·0.2) = 0.101024;
#          paper K = 0.1: 0.1·1.02 = 0.102.
#   KL 5:  e = −1/6. Code: 0.1·(1 − 0.0512/6) = 0.0991467; paper: 0.1·(1 − 0.1/6) = 0.0983333.
@pytest.mark.parametrize(
    "kl, kwargs, expected",
    [
        (12.0, dict(n_steps=512, horizon=10000), 0.101024),
        (12.0, dict(k_beta=0.1), 0.102),
        (12.0, dict(), 0.102),  # default K = the paper's 0.1
        (5.0, dict(n_steps=512, horizon=10000), 0.0991467),
        (5.0, dict(k_beta=0.1), 0.0983333),
        (6.0, dict(k_beta=0.1), 0.1),  # on target: unchanged
        (1e9, dict(k_beta=0.1), 0.102),  # error clipped at +0.2
        (0.0, dict(k_beta=0.1), 0.098),  # error clipped at −0.2
    ],
)
def test_ziegler_worked_examples(kl, kwargs, expected):
    c = build_controller("ziegler", beta=0.1, target=6.0, **kwargs)
    assert c.step(kl) == pytest.approx(expected, abs=1e-7)
    assert c.beta == pytest.approx(expected, abs=1e-7)


def test_ziegler_two_steps_compound():
    # 0.1 · 1.02 · 1.02 = 0.10404
    c = ZieglerKL(0.1, 6.0, k_beta=0.1)
    c.step(12.0)
    assert c.step(12.0) == pytest.approx(0.10404)


def test_adaptive_band():
    # factor 1.5, band [0.01, 0.05], bounds [0.02, 0.1]
    c = build_controller("adaptive", beta=0.04, low=0.01, high=0.05, beta_min=0.02, beta_max=0.1)
    assert c.step(0.03) == pytest.approx(0.04)  # inside the band: unchanged
    assert c.step(0.2) == pytest.approx(0.06)  # above: ×1.5
    assert c.step(0.2) == pytest.approx(0.09)
    assert c.step(0.2) == pytest.approx(0.1)  # 0.135 capped at beta_max
    assert c.step(0.001) == pytest.approx(0.1 / 1.5)  # below: ÷1.5
    assert c.step(0.001) == pytest.approx(0.1 / 1.5**2)
    assert c.step(0.001) == pytest.approx(0.1 / 1.5**3)  # 0.0296
    assert c.step(0.001) == pytest.approx(0.02)  # 0.0296 / 1.5 = 0.0198 floored at beta_min


def test_warmup_linear_and_cosine():
    # base 0.01, start_scale 5, 4 steps. linear scale = 1 + 4(1 − t/4): t = 0..4 -> 5, 4, 3, 2, 1
    c = build_controller("warmup", beta=0.01, steps=4, start_scale=5.0, shape="linear")
    assert c.beta == pytest.approx(0.05)
    assert [c.step(0.0) for _ in range(5)] == pytest.approx([0.04, 0.03, 0.02, 0.01, 0.01])
    # cosine: scale = 1 + 4·½(1 + cos(π t/4)): t = 1 -> 1 + 2(1 + 0.707107) = 4.414214; t = 2 -> 3
    c = build_controller("warmup", beta=0.01, steps=4, start_scale=5.0)
    assert c.beta == pytest.approx(0.05)
    assert c.step(0.0) == pytest.approx(0.04414214)
    assert c.step(0.0) == pytest.approx(0.03)


def test_warmup_step_holds_then_drops_to_the_inner_beta():
    # base 0.02, start_scale 4, 3 steps: β is 0.08 for the updates at t = 0, 1, 2 and 0.02 from t = 3
    c = build_controller("warmup", beta=0.02, steps=3, start_scale=4.0, shape="step")
    assert c.beta == pytest.approx(0.08)                                    # t = 0
    assert [c.step(0.5) for _ in range(5)] == pytest.approx([0.08, 0.08, 0.02, 0.02, 0.02])   # t = 1..5
    # start_scale 2.5 with steps 1: only the first update is warmed (0.05), the second is at 0.02
    c = WarmupKL(FixedKL(0.02), steps=1, start_scale=2.5, shape="step")
    assert (c.beta, c.step(0.0)) == pytest.approx((0.05, 0.02))


def test_warmup_step_over_an_adaptive_inner_drops_to_where_the_inner_is():
    # inner adaptive, factor 2, band [0, 1]: KL 5 doubles β_inner every step: 0.01 -> 0.02 -> 0.04
    c = build_controller("warmup", inner={"kind": "adaptive", "beta": 0.01, "low": 0.0, "high": 1.0, "factor": 2.0},
                         steps=2, start_scale=3.0, shape="step")
    assert c.beta == pytest.approx(0.03)
    assert c.step(5.0) == pytest.approx(0.02 * 3)      # t = 1 < 2: still scaled
    assert c.step(5.0) == pytest.approx(0.04)          # t = 2: the inner controller's own β


def test_default_warmup_starts_the_config_default_beta_inside_the_rules_range():
    """The warm-up rule: β 0.05-0.1 for the first ~1000 steps, then 0.02. With the config's
    default β the default start_scale starts inside that range, in every shape."""
    from grpokit.config import load_config

    base = load_config().algorithm.kl.beta
    assert base == 0.02
    for shape in ("step", "cosine", "linear"):
        c = build_controller("warmup", beta=base, steps=1000, shape=shape)
        assert 0.05 <= c.beta <= 0.1 and c.beta == pytest.approx(0.08)


@pytest.mark.parametrize("overrides", [
    [],
    ["algorithm.kl.controller=warmup", "algorithm.kl.controller_args={shape: step, steps: 1000, start_scale: 4}"],
], ids=["kl_warmup-preset", "grpo-one-liner"])
def test_the_warmup_rule_from_the_preset_and_from_overrides(overrides):
    """`kl_warmup` (and the documented overrides over `grpo`) give the trainer β 0.08 for steps
    0..999 and 0.02 from step 1000 on, whatever KL it observes."""
    from grpokit.config import load_config
    from grpokit.config.kl_control import build_kl_controller

    c = build_kl_controller(load_config(["grpo"] if overrides else ["kl_warmup"], overrides))
    betas = [c.beta] + [c.step(kl) for kl in [0.5, 0.0001, 3.0] * 334]   # β of steps 0..1002
    assert betas[:1000] == pytest.approx([0.08] * 1000)
    assert betas[1000:] == pytest.approx([0.02] * 3)


def test_warmup_step_resumes_mid_warmup_and_after_the_drop():
    import json

    a = build_controller("warmup", beta=0.02, steps=10, shape="step")
    for _ in range(6):
        a.step(0.1)
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"kind": "warmup", "t": 6, "inner": {"kind": "fixed", "beta": 0.02}}
    b = build_controller("warmup", beta=0.02, steps=10, shape="step")
    b.load_state_dict(state)
    assert b.beta == pytest.approx(0.08)                                   # t = 6: still warming up
    assert [b.step(0.1) for _ in range(5)] == pytest.approx([0.08] * 3 + [0.02] * 2)   # t = 7..11
    c = build_controller("warmup", beta=0.02, steps=10, shape="step")
    c.load_state_dict(b.state_dict())
    assert c.beta == pytest.approx(0.02) and c.t == 11                     # resumed after the drop
    with pytest.raises(ValueError, match="finite and >= 0"):
        c.load_state_dict({"kind": "warmup", "t": -1, "inner": {"kind": "fixed", "beta": 0.02}})
    assert c.t == 11


def test_schedule_linear_step_cosine():
    # total 10, start_frac 0.6, final_scale 0.2: scale 1 for t < 6, then linear to 0.2 at t = 10:
    # t = 6: 1, 7: 0.8, 8: 0.6, 9: 0.4, 10: 0.2, 11: 0.2
    c = build_controller("schedule", beta=1.0, total_steps=10, start_frac=0.6, final_scale=0.2)
    betas = [c.beta] + [c.step(0.0) for _ in range(11)]
    assert betas == pytest.approx([1, 1, 1, 1, 1, 1, 1, 0.8, 0.6, 0.4, 0.2, 0.2])
    c = ScheduleKL(beta=1.0, total_steps=10, start_frac=0.6, final_scale=0.2, shape="step")
    assert [c.step(0.0) for _ in range(7)] == pytest.approx([1, 1, 1, 1, 1, 0.2, 0.2])
    # cosine at the midpoint of the decay (t = 8): 0.2 + 0.8·½(1 + cos(π/2)) = 0.6
    c = ScheduleKL(FixedKL(1.0), total_steps=10, start_frac=0.6, final_scale=0.2, shape="cosine")
    assert [c.step(0.0) for _ in range(8)][-1] == pytest.approx(0.6)


def test_composition_warmup_over_adaptive_and_schedule_over_warmup():
    # inner adaptive (factor 2) sees every KL: β_inner 0.1 -> 0.2 -> 0.4; warmup scale 3 -> 2 -> 1
    c = build_controller(
        "warmup",
        inner={"kind": "adaptive", "beta": 0.1, "low": 0.0, "high": 1.0, "factor": 2.0},
        steps=2,
        start_scale=3.0,
        shape="linear",
    )
    assert c.beta == pytest.approx(0.3)
    assert c.step(5.0) == pytest.approx(0.2 * 2)
    assert c.step(5.0) == pytest.approx(0.4 * 1)
    outer = ScheduleKL(WarmupKL(beta=0.1, steps=2, start_scale=3.0, shape="linear"), total_steps=4,
                       start_frac=0.5, final_scale=0.0)
    # t: 0 -> 0.3·1, 1 -> 0.2·1, 2 -> 0.1·1, 3 -> 0.1·0.5, 4 -> 0
    betas = [outer.beta] + [outer.step(0.0) for _ in range(4)]
    assert betas == pytest.approx([0.3, 0.2, 0.1, 0.05, 0.0])


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        ("fixed", dict(beta=0.1)),
        ("adaptive", dict(beta=0.1, low=0.01, high=0.02)),
        ("ziegler", dict(beta=0.1, target=6.0)),
        ("warmup", dict(inner={"kind": "ziegler", "beta": 0.1, "target": 6.0}, steps=5)),
        ("warmup", dict(inner={"kind": "adaptive", "beta": 0.1, "low": 0.01, "high": 0.02}, steps=2, shape="step")),
        ("schedule", dict(beta=0.1, total_steps=6, start_frac=0.5)),
    ],
)
def test_state_dict_round_trip(kind, kwargs):
    a, b = build_controller(kind, **kwargs), build_controller(kind, **kwargs)
    assert isinstance(a, KLController)
    for kl in (0.5, 20.0, 0.001):
        a.step(kl)
    b.load_state_dict(a.state_dict())
    assert b.beta == a.beta
    assert b.step(3.0) == a.step(3.0)
    with pytest.raises(ValueError, match="state_dict is for"):
        b.load_state_dict({"kind": "other"})


@pytest.mark.parametrize("kind", sorted(CONTROLLERS))
def test_nonfinite_kl_raises(kind):
    kwargs = {"beta": 0.1, "low": 0.1, "high": 0.2, "target": 1.0, "steps": 2, "total_steps": 3}
    allowed = {
        "fixed": ["beta"], "adaptive": ["beta", "low", "high"], "ziegler": ["beta", "target"],
        "warmup": ["beta", "steps"], "schedule": ["beta", "total_steps"],
    }[kind]
    c = build_controller(kind, **{k: kwargs[k] for k in allowed})
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            c.step(bad)


@pytest.mark.parametrize(
    "kind, kwargs, match",
    [
        ("adaptve", dict(beta=0.1), "did you mean 'adaptive'"),
        ("fixed", dict(beta=0.1, target=3), "unexpected keyword"),
        ("fixed", dict(beta=-1.0), "beta"),
        ("adaptive", dict(beta=0.1, low=0.2, high=0.1), "low <= high"),
        ("adaptive", dict(beta=0.1, low=0.0, high=0.1, factor=1.0), "factor"),
        ("adaptive", dict(beta=20.0, low=0.0, high=0.1), "beta_max"),
        ("ziegler", dict(beta=0.1, target=0.0), "target > 0"),
        ("ziegler", dict(beta=0.1, target=1.0, n_steps=5, k_beta=0.1), "not both"),
        ("warmup", dict(steps=3), "needs beta or inner"),
        ("warmup", dict(beta=0.1, steps=3, shape="exp"), "shape"),
        ("warmup", dict(beta=0.1, steps=3, shape="steps"), "shape must be one of .*'step'"),
        ("warmup", dict(beta=0.1, steps=0, shape="step"), "steps must be finite and >= 1"),
        ("warmup", dict(beta=0.1, steps=2.5, shape="step"), "whole number"),
        ("warmup", dict(beta=0.1, steps=None, shape="step"), "steps must be a number"),
        ("warmup", dict(beta=0.1, shape="step"), "missing 1 required keyword-only argument: 'steps'"),
        ("warmup", dict(beta=0.1, steps=3, shape="step", start_scale=0.5), "start_scale must be finite and >= 1"),
        ("warmup", dict(beta=0.1, steps=3, shape="step", start_scale="high"), "start_scale must be a number"),
        ("warmup", dict(beta=0.1, steps=3, shape="step", keep=3), "unexpected keyword"),
        ("warmup", dict(beta=0.1, steps=3, shape="step", hold=3), "hold must be true or false"),
        ("warmup", dict(beta=0.1, inner={"kind": "fixed", "beta": 0.1}, steps=3, shape="step"), "not both"),
        ("schedule", dict(beta=0.1, total_steps=3, start_frac=1.5), "start_frac"),
    ],
)
def test_bad_arguments(kind, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_controller(kind, **kwargs)


def test_trainer_builds_the_adaptive_controller_from_config():
    """`algorithm.kl.adapt_factor` (default 1.05) and the band reach the trainer's controller;
    `controller_args` still override them."""
    from grpokit.config import load_config
    from grpokit.config.kl_control import build_kl_controller

    c = build_kl_controller(load_config(["grpo"], ["algorithm.kl.warmup_steps=0"]))
    assert c.beta == pytest.approx(0.02)
    assert c.step(20.0) == pytest.approx(0.02 * 1.05)            # above the band [1, 10] (per completion)
    assert c.step(5.0) == pytest.approx(0.02 * 1.05)             # inside: unchanged
    assert c.step(0.5) == pytest.approx(0.02)                    # below: divided
    c = build_kl_controller(load_config(["grpo"], ["algorithm.kl.adapt_factor=2", "algorithm.kl.target_unit=token",
                                                   "algorithm.kl.warmup_steps=0",
                                                   "algorithm.kl.target_low=0.01", "algorithm.kl.target_high=0.2"]))
    assert c.step(0.15) == pytest.approx(0.02)
    assert c.step(0.3) == pytest.approx(0.04)
    c = build_kl_controller(load_config(["grpo"], ["algorithm.kl.controller_args={factor: 1.5}",
                                                   "algorithm.kl.warmup_steps=0"]))
    assert c.step(20.0) == pytest.approx(0.03)


@pytest.mark.parametrize("steps, warm", [(100, 10), (50000, 1000), (5, 0)])
def test_the_default_controller_holds_beta_through_the_warmup_then_the_band_rules(steps, warm):
    """The default run: beta held at 4 x 0.02 for a tenth of the run (at most 1000 steps) whatever
    KL it sees (the band would have divided it at every step), then the adaptive band takes over
    from 0.02, not from where a stepped controller would have drifted; `handed_over` marks the step."""
    from grpokit.config import load_config
    from grpokit.config.kl_control import build_kl_controller, warmup_steps

    cfg = load_config(None, [f"train.steps={steps}"])
    assert warmup_steps(cfg) == warm
    c = build_kl_controller(cfg)
    betas, handed = [c.beta], []
    for t in range(warm + 3):
        betas.append(c.step(0.01))                              # far below the band [1, 10]
        handed.append(getattr(c, "handed_over", False))
    assert betas[:warm] == pytest.approx([0.08] * warm)
    assert betas[warm:] == pytest.approx([0.02, 0.02 / 1.05, 0.02 / 1.05 ** 2, 0.02 / 1.05 ** 3])
    assert handed == [t == warm - 1 for t in range(warm + 3)] if warm else not any(handed)


def test_a_warmup_is_not_added_to_a_controller_that_shapes_beta_itself():
    from grpokit.config import load_config
    from grpokit.config.kl_control import warmup_steps

    assert warmup_steps(load_config(["kl_warmup"])) == 0 and warmup_steps(load_config(["reinforce"])) == 0
    assert warmup_steps(load_config(["dapo_paper"])) == 0                 # beta = 0: nothing to warm up
    with pytest.raises(ValueError, match="warmup controller is one already"):
        load_config(["kl_warmup"], ["algorithm.kl.warmup_steps=5"])


def test_a_held_warmup_resumes_from_a_state_saved_without_one():
    """A checkpoint written before the default warm-up existed holds the adaptive controller's state
    alone: it loads into the held warm-up as a controller already in charge."""
    inner = build_controller("adaptive", beta=0.02, low=1.0, high=10.0)
    inner.step(0.01)
    held = build_controller("warmup", inner=build_controller("adaptive", beta=0.02, low=1.0, high=10.0),
                            steps=10, shape="step", hold=True)
    held.load_state_dict(inner.state_dict())
    assert held.beta == pytest.approx(0.02 / 1.5) and held.t == 10
    fresh = build_controller("warmup", inner=build_controller("adaptive", beta=0.02, low=1.0, high=10.0),
                             steps=10, shape="step", hold=True)
    fresh.step(0.01)
    held.load_state_dict(fresh.state_dict())                    # its own state: mid-warm-up
    assert held.t == 1 and held.beta == pytest.approx(0.08)


# ---------------------------------------------------------------------------------------------
# Properties over random KL sequences (hypothesis)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_kls = st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(kls=_kls, beta=st.floats(1e-4, 5.0), factor=st.floats(1.01, 3.0))
def test_adaptive_beta_stays_in_its_bounds_and_moves_by_the_band_rule(kls, beta, factor):
    c = AdaptiveKL(beta, 0.01, 0.1, factor=factor, beta_min=1e-4, beta_max=5.0)
    for kl in kls:
        before = c.beta
        after = c.step(kl)
        assert 1e-4 <= after <= 5.0
        if kl > 0.1:
            assert after >= before and after <= before * factor * (1 + 1e-12)
        elif kl < 0.01:
            assert after <= before and after >= before / factor * (1 - 1e-12)
        else:
            assert after == before


@settings(max_examples=60, deadline=None)
@given(kls=_kls, beta=st.floats(1e-4, 5.0), k=st.floats(0.0, 4.9), target=st.floats(1e-3, 10.0))
def test_ziegler_step_is_bounded_by_its_clipped_error(kls, beta, k, target):
    c = ZieglerKL(beta, target, k_beta=k)
    for kl in kls:
        before = c.beta
        after = c.step(kl)
        ratio = after / before
        assert 1 - 0.2 * k - 1e-12 <= ratio <= 1 + 0.2 * k + 1e-12
        assert (ratio >= 1) == (kl >= target) or math.isclose(ratio, 1.0)


@settings(max_examples=60, deadline=None)
@given(kls=_kls, steps=st.integers(1, 30), start=st.floats(1.0, 50.0), shape=st.sampled_from(["linear", "cosine", "step"]))
def test_warmup_scale_decays_from_start_to_one(kls, steps, start, shape):
    c = WarmupKL(beta=0.02, steps=steps, start_scale=start, shape=shape)
    prev = c.beta
    assert math.isclose(prev, 0.02 * start)
    for kl in kls:
        b = c.step(kl)
        assert 0.02 * (1 - 1e-12) <= b <= prev * (1 + 1e-12)      # never rises, never below the base
        prev = b
    if len(kls) >= steps:
        assert math.isclose(c.beta, 0.02)


@settings(max_examples=60, deadline=None)
@given(kls=_kls, total=st.integers(1, 40), start_frac=st.floats(0.0, 1.0), final=st.floats(0.0, 1.0),
       shape=st.sampled_from(["linear", "cosine", "step"]))
def test_schedule_scale_stays_between_final_and_one(kls, total, start_frac, final, shape):
    c = ScheduleKL(beta=0.05, total_steps=total, start_frac=start_frac, final_scale=final, shape=shape)
    prev = c.beta
    for kl in kls:
        b = c.step(kl)
        assert 0.05 * final * (1 - 1e-12) <= b <= 0.05 * (1 + 1e-12) and b <= prev * (1 + 1e-12)
        prev = b
    if len(kls) >= total:
        assert math.isclose(c.beta, 0.05 * final, abs_tol=1e-15)


@settings(max_examples=40, deadline=None)
@given(kls=_kls, split=st.integers(0, 60),
       kind=st.sampled_from(["fixed", "adaptive", "ziegler", "warmup", "schedule"]))
def test_a_restored_controller_continues_exactly_like_the_original(kls, split, kind):
    import json
    kwargs = {"fixed": dict(beta=0.04), "adaptive": dict(beta=0.04, low=0.01, high=0.1),
              "ziegler": dict(beta=0.04, target=0.05), "warmup": dict(beta=0.04, steps=7),
              "schedule": dict(beta=0.04, total_steps=20)}[kind]
    a, b = build_controller(kind, **kwargs), build_controller(kind, **kwargs)
    split = min(split, len(kls))
    for kl in kls[:split]:
        a.step(kl)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for kl in kls[split:]:
        assert a.step(kl) == b.step(kl)


@pytest.mark.parametrize("kind,kwargs,state,match", [
    ("fixed", dict(beta=0.1), {"kind": "fixed", "beta": float("nan")}, "finite"),
    ("fixed", dict(beta=0.1), {"kind": "fixed"}, "no 'beta'"),
    ("adaptive", dict(beta=0.1, low=0.01, high=0.1, beta_max=10.0), {"kind": "adaptive", "beta": 100.0}, "above its bound"),
    ("ziegler", dict(beta=0.1, target=1.0), {"kind": "ziegler", "beta": -1.0}, "finite and >= 0"),
    ("warmup", dict(beta=0.1, steps=5), {"kind": "warmup", "t": 2}, "no 'inner'"),
    ("schedule", dict(beta=0.1, total_steps=5), ["not", "a", "dict"], "not 'schedule'"),
])
def test_a_bad_state_is_refused_not_loaded(kind, kwargs, state, match):
    c = build_controller(kind, **kwargs)
    with pytest.raises(ValueError, match=match):
        c.load_state_dict(state)
    assert c.beta == pytest.approx(build_controller(kind, **kwargs).beta)


@pytest.mark.parametrize("kind,kwargs", [
    ("fixed", dict(beta=float("inf"))),
    ("adaptive", dict(beta=0.1, low=0.01, high=0.1, beta_max=float("inf"))),
    ("ziegler", dict(beta=float("nan"), target=1.0)),
    ("schedule", dict(beta=0.1, total_steps=5, final_scale=float("inf"))),
    ("warmup", dict(beta=0.1, steps=5, start_scale=float("inf"))),
])
def test_non_finite_arguments_are_refused(kind, kwargs):
    with pytest.raises(ValueError, match="finite"):
        build_controller(kind, **kwargs)


def test_a_resumed_default_run_keeps_the_warmup_it_started_with():
    """The default warm-up's length follows train.steps; a run resumed with more steps (or fewer,
    down to no warm-up at all) finds the controller its checkpoint holds and the length saved in it."""
    from grpokit.config import load_config
    from grpokit.config.kl_control import build_kl_controller

    first = build_kl_controller(load_config(None, ["train.steps=40"]))     # 4 steps of warm-up
    for _ in range(2):
        first.step(0.01)
    for steps in (400, 5):                                                  # 40 steps / none by default
        resumed = build_kl_controller(load_config(None, [f"train.steps={steps}"]))
        resumed.load_state_dict(first.state_dict())
        betas = [resumed.step(0.01) for _ in range(3)]
        assert betas == pytest.approx([0.08, 0.02, 0.02 / 1.05])           # 2 more held, then the band


def test_an_asked_for_warmup_holds_a_fixed_beta_too():
    from grpokit.config import load_config
    from grpokit.config.kl_control import build_kl_controller

    c = build_kl_controller(load_config(None, ["algorithm.kl.controller=fixed", "algorithm.kl.warmup_steps=2"]))
    assert [c.beta] + [c.step(5.0) for _ in range(3)] == pytest.approx([0.08, 0.08, 0.02, 0.02])
    assert build_kl_controller(load_config(None, ["algorithm.kl.controller=fixed"])).beta == pytest.approx(0.02)
