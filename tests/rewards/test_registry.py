"""Registry, RewardSpec/RewardSet composition, containment of failing rewards, cross-checking."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import threading
import time

import pytest
import yaml

from grpokit.rewards import REGISTRY, CrossCheck, RewardSet, RewardSpec, get, register
from tests.rewards.clocks import under_load




def cols(n, **extra):
    base = dict(answer=["4"] * n, completion_length=[10] * n, finish_reason=["eos"] * n,
                group_id=[0] * n, max_new_tokens=[64] * n)
    base.update(extra)
    return base


# --------------------------------------------------------------------------- registry


def test_builtins_are_registered():
    for name in ("math_accuracy", "math_accuracy_alt", "code_tests", "exact_match", "numeric_match",
                 "think_answer_format", "boxed_format", "code_format", "soft_overlong", "ngram_repetition",
                 "length_group", "format_violation"):
        assert get(name) is REGISTRY[name]


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown reward 'math_acuracy'.*did you mean 'math_accuracy'"):
        get("math_acuracy")


def _zero(prompts, completions, **columns):
    return [0.0] * len(completions)


def _one(prompts, completions, **columns):
    return [1.0] * len(completions)


def test_name_clash_is_an_error_but_a_redefinition_replaces(temp_rewards):
    temp_rewards("t_dup", _zero)
    with pytest.raises(ValueError, match="already registered"):
        register("t_dup")(_one)
    # the same definition executed again (a notebook cell, a re-imported module) replaces it
    again = type(_zero)(_zero.__code__, _zero.__globals__, "_zero")
    assert register("t_dup")(again) is again and REGISTRY["t_dup"] is again


def test_import_is_light():
    # registering the built-ins starts no process or thread and loads no sympy/math-verify
    code = ("import os, sys, threading\nimport grpokit.rewards\n"
            "kids = open(f'/proc/self/task/{os.getpid()}/children').read().split()\n"
            "heavy = [m for m in ('sympy', 'math_verify') if m in sys.modules]\n"
            "print(len(kids), threading.active_count(), len(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "1", "0"]


# --------------------------------------------------------------------------- specs


def test_spec_validation():
    assert RewardSpec(name="x").weight == 1.0
    with pytest.raises(ValueError, match="unknown key 'wieght'.*did you mean 'weight'"):
        RewardSpec.model_validate({"name": "x", "wieght": 2})
    with pytest.raises(ValueError):
        RewardSpec(name="x", weight=float("inf"))
    with pytest.raises(ValueError):
        RewardSpec(name="x", timeout_s=0)


def test_from_specs_errors_are_eager():
    with pytest.raises(ValueError, match="did you mean 'soft_overlong'"):
        RewardSet.from_specs([{"name": "soft_overlon"}])
    with pytest.raises(ValueError, match=r"reward 'soft_overlong' has no argument 'max_length'.*did you mean 'max_len'"):
        RewardSet.from_specs([{"name": "soft_overlong", "args": {"max_length": 64}}])
    with pytest.raises(ValueError, match=r"reward 'soft_overlong': bad value 'long' for argument 'max_len'"):
        RewardSet.from_specs([{"name": "soft_overlong", "args": {"max_len": "long"}}])
    with pytest.raises(ValueError, match="listed twice"):
        RewardSet.from_specs([{"name": "exact_match"}, {"name": "exact_match"}])
    with pytest.raises(ValueError, match="not among the rewards"):
        RewardSet.from_specs([{"name": "exact_match"}], crosscheck={"primary": "math_accuracy", "checker": "math_accuracy_alt"})
    with pytest.raises(ValueError, match="unknown key 'fractoin'"):
        RewardSet.from_specs([{"name": "exact_match"}], crosscheck={"primary": "exact_match", "checker": "numeric_match", "fractoin": 1})


def test_yaml_config_plugs_in_by_name():
    cfg = yaml.safe_load("""
rewards:
  - {name: math_accuracy, weight: 1.0}
  - {name: soft_overlong, weight: 0.5, args: {max_len: 64, cache: 16}}
  - {name: think_answer_format, weight: 0.1}
""")
    rs = RewardSet.from_specs(cfg["rewards"])
    comps = [r"<think>2+2</think><answer>\boxed{4}</answer>", r"\boxed{5}", r"\boxed{4}"]
    out = rs.score(["q"] * 3, comps, cols(3, completion_length=[10, 56, 64]))
    # math 1, 0, 1; overlong 0, (48-56)/16 = -0.5, -1; format 1, 0, 0
    assert out.per_fn == {"math_accuracy": [1.0, 0.0, 1.0], "soft_overlong": [0.0, -0.5, -1.0],
                          "think_answer_format": [1.0, 0.0, 0.0]}
    assert out.total == pytest.approx([1.1, -0.25, 0.5])
    m = out.metrics
    assert m["reward/math_accuracy/mean"] == pytest.approx(2 / 3)
    assert m["reward/soft_overlong/mean"] == pytest.approx(-0.5)
    assert m["reward/math_accuracy/errors"] == 0.0 and m["reward/math_accuracy/none_frac"] == 0.0
    assert m["reward/total_nan_frac"] == 0.0


def test_none_makes_the_total_nan():
    rs = RewardSet.from_specs([{"name": "exact_match"}, {"name": "ngram_repetition"}])
    out = rs.score(["q", "q"], ["4", "4"], cols(2, answer=["4", None]))
    assert out.total[0] == 1.0 and math.isnan(out.total[1])
    assert out.metrics["reward/exact_match/none_frac"] == 0.5
    assert out.metrics["reward/total_nan_frac"] == 0.5


def test_column_length_mismatch_is_the_callers_bug():
    rs = RewardSet.from_specs([{"name": "exact_match"}])
    with pytest.raises(ValueError, match="column 'answer'"):
        rs.score(["q", "q"], ["4", "4"], cols(2, answer=["4"]))


# --------------------------------------------------------------------------- containment


def test_raising_reward_is_contained_and_logged_once(temp_rewards, caplog):
    def boom(prompts, completions, **columns):
        raise RuntimeError("reward bug")

    temp_rewards("t_boom", boom)
    rs = RewardSet.from_specs([{"name": "t_boom"}, {"name": "exact_match"}])
    with caplog.at_level(logging.DEBUG, logger="grpokit.rewards"):
        for _ in range(3):
            out = rs.score(["q", "q"], ["4", "5"], cols(2))
            assert out.per_fn["t_boom"] == [None, None] and out.per_fn["exact_match"] == [1.0, 0.0]
            assert all(math.isnan(t) for t in out.total)
            assert out.metrics["reward/t_boom/errors"] == 2.0 and out.metrics["reward/t_boom/none_frac"] == 1.0
            assert math.isnan(out.metrics["reward/t_boom/mean"])
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "RuntimeError: reward bug" in errors[0].getMessage()
    assert rs.error_counts["t_boom"] == 3


def _held(release: threading.Event, finished: threading.Event, limit_s: float = 30.0) -> None:
    """Sleep until `release` is set (`limit_s` at most), then set `finished`: a reward held like this
    cannot return before the test releases it, so a caller that returns first did not wait for it."""
    deadline = time.monotonic() + limit_s
    while not release.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    finished.set()


def test_slow_reward_hits_its_budget(temp_rewards, caplog):
    release, finished = threading.Event(), threading.Event()
    temp_rewards("t_slow", lambda p, c, **k: _held(release, finished) or [1.0] * len(c))
    rs = RewardSet.from_specs([{"name": "t_slow", "timeout_s": 0.2}, {"name": "exact_match"}])
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
            out = rs.score(["q"], ["4"], cols(1))
        took, held = time.monotonic() - t0, not finished.is_set()
    finally:
        release.set()
    assert held and took < under_load(1.5), took  # cut off at its budget (0.2 s), not waited for
    assert out.per_fn["t_slow"] == [None] and out.metrics["reward/t_slow/errors"] == 1.0  # one sample
    assert "time budget" in caplog.text and "time.sleep" in caplog.text  # where it was stuck


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["no-budget", "budget"])
def test_sys_exit_in_a_reward_is_contained(temp_rewards, caplog, timeout_s):
    # without a budget the reward runs in the caller's thread, where SystemExit would end training
    temp_rewards("t_exit", lambda p, c, **k: sys.exit(3))
    rs = RewardSet.from_specs([{"name": "t_exit", "timeout_s": timeout_s}, {"name": "exact_match"}])
    with caplog.at_level(logging.DEBUG, logger="grpokit.rewards"):
        for _ in range(2):
            out = rs.score(["q", "q"], ["4", "5"], cols(2))
            assert out.per_fn["t_exit"] == [None, None] and out.per_fn["exact_match"] == [1.0, 0.0]
            assert out.metrics["reward/t_exit/errors"] == 2.0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "SystemExit: 3" in errors[0].getMessage()  # the traceback, once
    assert rs.error_counts["t_exit"] == 2


def test_keyboard_interrupt_in_a_reward_still_stops(temp_rewards):
    def interrupted(prompts, completions, **columns):
        raise KeyboardInterrupt

    temp_rewards("t_ctrl_c", interrupted)
    for timeout_s in (None, 5.0):
        rs = RewardSet.from_specs([{"name": "t_ctrl_c", "timeout_s": timeout_s}])
        with pytest.raises(KeyboardInterrupt):
            rs.score(["q"], ["4"], cols(1))


def test_rewards_have_a_time_budget_by_default(temp_rewards):
    from grpokit.config import CrossCheckConfig, RewardSpecConfig, load_config
    from grpokit.rewards.compose import DEFAULT_TIMEOUT_S

    assert DEFAULT_TIMEOUT_S == 300.0
    # "auto": DEFAULT_TIMEOUT_S, except for a reward that declares its own per-sample limits
    assert RewardSpec(name="x").timeout_s == "auto"
    assert RewardSpecConfig(name="exact_match").timeout_s == "auto"  # the config says the same
    assert CrossCheck(primary="x", checker="y").timeout_s == "auto"
    assert CrossCheckConfig(primary="x").timeout_s == "auto"
    # a reward from the config, with no timeout_s given, runs under the default budget ...
    cfg = load_config(None, ["rewards=[{name: exact_match}]"])
    rs = RewardSet.from_specs([r.model_dump() for r in cfg.rewards])
    assert rs.specs[0].timeout_s == DEFAULT_TIMEOUT_S
    # ... and `timeout_s: null` still turns the budget off
    cfg = load_config(None, ["rewards=[{name: exact_match, timeout_s: null}]"])
    assert RewardSet.from_specs([r.model_dump() for r in cfg.rewards]).specs[0].timeout_s is None


def test_builtins_with_their_own_per_sample_limits_declare_it():
    for name in ("math_accuracy", "math_accuracy_alt", "code_tests"):
        assert REGISTRY[name].own_time_limit is True, name
    for name in ("exact_match", "think_answer_format", "soft_overlong", "length_group"):
        assert REGISTRY[name].own_time_limit is False, name
    rs = RewardSet.from_specs([{"name": "math_accuracy"}, {"name": "code_tests"}, {"name": "exact_match"}],
                              crosscheck={"primary": "math_accuracy", "checker": "math_accuracy_alt"})
    from grpokit.rewards.compose import DEFAULT_TIMEOUT_S

    assert [s.timeout_s for s in rs.specs] == [None, None, DEFAULT_TIMEOUT_S]
    assert rs.checker_timeout_s is None  # math_accuracy_alt bounds its samples too
    rs = RewardSet.from_specs([{"name": "math_accuracy", "timeout_s": 60}],  # an explicit budget is kept
                              crosscheck={"primary": "math_accuracy", "checker": _one, "timeout_s": "auto"})
    assert rs.specs[0].timeout_s == 60.0 and rs.checker_timeout_s == DEFAULT_TIMEOUT_S  # a plain callable


def test_own_time_limit_skips_the_default_budget_only(temp_rewards, monkeypatch):
    """A batch over the per-call budget scores None for every sample (advantage 0): a reward that
    bounds each sample itself is not put under the default budget, a plain function still is, and
    an explicit timeout_s applies to both."""
    from grpokit.config import load_config
    from grpokit.rewards import compose

    monkeypatch.setattr(compose, "DEFAULT_TIMEOUT_S", 0.1)

    def slow(prompts, completions, **columns):  # e.g. many answers that each take their full limit
        time.sleep(0.4)
        return [0.0] * len(completions)

    temp_rewards("t_plain_slow", slow)
    register("t_own_slow", own_time_limit=True)(lambda p, c, **k: slow(p, c))
    try:
        cfg = load_config(None, ["rewards=[{name: t_own_slow}, {name: t_plain_slow}]"])
        rs = RewardSet.from_specs([r.model_dump() for r in cfg.rewards])  # as the trainer builds it
        assert [s.timeout_s for s in rs.specs] == [None, 0.1]
        out = rs.score(["q", "q"], ["a", "b"], cols(2))
        assert out.per_fn["t_own_slow"] == [0.0, 0.0]  # scored, not None
        assert out.per_fn["t_plain_slow"] == [None, None] and out.metrics["reward/t_plain_slow/errors"] == 2.0
        out = RewardSet.from_specs([{"name": "t_own_slow", "timeout_s": 0.1}]).score(["q"], ["a"], cols(1))
        assert out.per_fn["t_own_slow"] == [None]  # the user's explicit budget holds
    finally:
        REGISTRY.pop("t_own_slow", None)


def test_a_reward_that_needs_the_main_thread_can_opt_out_of_the_budget(temp_rewards, caplog):
    import signal

    def with_alarm(prompts, completions, **columns):  # as math_verify's own timeouts do
        old = signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.signal(signal.SIGALRM, old)
        return [1.0] * len(completions)

    temp_rewards("t_alarm", with_alarm)
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        out = RewardSet.from_specs([{"name": "t_alarm"}]).score(["q"], ["a"], cols(1))
    assert out.per_fn["t_alarm"] == [None] and "timeout_s: null" in caplog.text  # the log says what to do
    out = RewardSet.from_specs([{"name": "t_alarm", "timeout_s": None}]).score(["q"], ["a"], cols(1))
    assert out.per_fn["t_alarm"] == [1.0]


@pytest.mark.parametrize("bad", [[1.0], "1.0", [1.0, "x"], [1.0, float("inf")], None, 3.0])
def test_malformed_return_values_are_errors(temp_rewards, bad):
    temp_rewards("t_bad", lambda p, c, **k: bad)
    rs = RewardSet.from_specs([{"name": "t_bad"}])
    out = rs.score(["q", "q"], ["a", "b"], cols(2))
    assert out.per_fn["t_bad"] == [None, None] and out.metrics["reward/t_bad/errors"] == 2.0


def test_nan_score_means_cannot_score_and_numpy_scalars_are_fine(temp_rewards):
    import numpy as np

    temp_rewards("t_np", lambda p, c, **k: [np.float32(0.5), float("nan")])
    out = RewardSet.from_specs([{"name": "t_np"}]).score(["q", "q"], ["a", "b"], cols(2))
    assert out.per_fn["t_np"] == [0.5, None] and out.metrics["reward/t_np/errors"] == 0.0


def test_args_and_columns_reach_the_reward(temp_rewards):
    seen = {}

    def spy(prompts, completions, *, scale: float = 1.0, **columns):
        seen.update(columns, scale=scale)
        return [scale] * len(completions)

    temp_rewards("t_spy", spy)
    out = RewardSet.from_specs([{"name": "t_spy", "args": {"scale": 2}, "weight": 3}]).score(["q"], ["a"], cols(1, extra=["e"]))
    assert out.total == [6.0] and seen["scale"] == 2.0 and seen["extra"] == ["e"] and seen["finish_reason"] == ["eos"]


# --------------------------------------------------------------------------- cross-checking


def test_crosscheck_reports_disagreement_and_dumps_samples(temp_rewards, tmp_path):
    # the checker says the opposite of exact_match on completions that contain "!"
    temp_rewards("t_judge", lambda p, c, answer, **k: [float((x.strip() == a) != ("!" in x)) for x, a in zip(c, answer)])
    dump = tmp_path / "sub" / "disagree.jsonl"
    rs = RewardSet.from_specs([{"name": "exact_match"}],
                              crosscheck=CrossCheck(primary="exact_match", checker="t_judge", fraction=1.0, dump_path=dump))
    out = rs.score(["q"] * 4, ["4", "4!", "5", "5!"], cols(4))
    assert out.metrics["reward/checker_checked"] == 4.0
    assert out.metrics["reward/checker_disagreement"] == 0.5
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [(r["index"], r["completion"], r["primary_score"], r["checker_score"]) for r in rows] == [
        (1, "4!", 0.0, 1.0), (3, "5!", 0.0, 1.0)]
    assert rows[0]["columns"]["answer"] == "4" and rows[0]["checker"] == "t_judge"
    rs.score(["q"] * 4, ["4", "4!", "5", "5!"], cols(4))
    assert len(dump.read_text().splitlines()) == 4  # appended


def test_crosscheck_fraction_and_callable_checker():
    calls = []

    def judge(prompts, completions, **columns):
        calls.append(len(completions))
        return [1.0] * len(completions)

    rs = RewardSet.from_specs([{"name": "exact_match"}], crosscheck={"primary": "exact_match", "checker": judge, "fraction": 0.25})
    n_checked = 0
    for _ in range(20):
        n_checked += rs.score(["q"] * 20, ["4"] * 20, cols(20)).metrics["reward/checker_checked"]
    assert 60 <= n_checked <= 140  # about 25% of 400
    off = RewardSet.from_specs([{"name": "exact_match"}], crosscheck={"primary": "exact_match", "checker": judge, "fraction": 0.0})
    assert off.score(["q"], ["4"], cols(1)).metrics["reward/checker_checked"] == 0.0


def test_crosscheck_checker_failure_is_contained():
    def broken(prompts, completions, **columns):
        raise ValueError("judge down")

    rs = RewardSet.from_specs([{"name": "exact_match"}], crosscheck={"primary": "exact_match", "checker": broken, "fraction": 1.0})
    out = rs.score(["q"], ["4"], cols(1))
    assert out.metrics["reward/checker/errors"] == 1.0 and out.total == [1.0]


def test_crosscheck_tol_and_timeout_from_config_reach_the_checker(temp_rewards, tmp_path):
    from grpokit.config import load_config
    from grpokit.train import build_rewards

    # exact_match pays 1.0 for "4"; this checker pays 0.7 for it and is held on "slow"
    release, finished = threading.Event(), threading.Event()

    def close_judge(prompts, completions, **columns):
        if "slow" in completions:
            _held(release, finished)
        return [0.7] * len(completions)

    temp_rewards("t_close_judge", close_judge)
    run = tmp_path / "run.yaml"
    run.write_text("rewards: [{name: exact_match}]\n"
                   "crosscheck: {primary: exact_match, checker: t_close_judge, fraction: 1.0, tol: 0.5}\n")
    cfg = load_config(str(run), ["crosscheck.timeout_s=0.2"])
    assert (cfg.crosscheck.tol, cfg.crosscheck.timeout_s) == (0.5, 0.2)
    rs = build_rewards(cfg, run_dir=tmp_path)
    assert (rs.crosscheck.tol, rs.crosscheck.timeout_s) == (0.5, 0.2)
    out = rs.score(["q"], ["4"], cols(1))
    assert out.metrics["reward/checker_checked"] == 1.0
    assert out.metrics["reward/checker_disagreement"] == 0.0  # |1.0 - 0.7| <= tol 0.5
    t0 = time.monotonic()
    try:
        out = rs.score(["q"], ["slow"], cols(1))
        took, held = time.monotonic() - t0, not finished.is_set()
    finally:
        release.set()
    assert held and took < under_load(1.5), took  # cut off at its budget (0.2 s), not waited for
    assert out.metrics["reward/checker/errors"] == 1.0
    # with the default tol the same scores disagree
    strict = build_rewards(load_config(str(run), ["crosscheck.tol=1e-6"]), run_dir=tmp_path)
    assert strict.score(["q"], ["4"], cols(1)).metrics["reward/checker_disagreement"] == 1.0


def test_math_crosscheck_with_builtin_independent_checker(tmp_path):
    dump = tmp_path / "math.jsonl"
    rs = RewardSet.from_specs([{"name": "math_accuracy", "args": {"answer_column": "solution"}}],
                              crosscheck={"primary": "math_accuracy", "checker": "math_accuracy_alt", "fraction": 1.0,
                                          "dump_path": str(dump)})
    comps = [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"It is \boxed{4} or maybe \boxed{3}", r"\boxed{7}"]
    out = rs.score(["q"] * 4, comps, cols(4, solution=["0.5", "1/2", "3", "3"]))
    assert out.per_fn["math_accuracy"] == [1.0, 1.0, 0.0, 0.0]
    # the alt checker (answer_column inherited from the primary) reads only the last box: it
    # accepts the hedge, so exactly that sample disagrees and is dumped
    assert out.metrics["reward/checker_disagreement"] == 0.25
    assert [json.loads(x)["index"] for x in dump.read_text().splitlines()] == [2]
