"""Unit tests of the data-layer switches: proxy filters, dynamic-sampling group test, curriculum,
wrong-answer rewriting."""

import math

from grpokit.data.curriculum import Curriculum
from grpokit.data.filters import ProxyRules, proxy_filter, zero_variance_groups


def test_zero_variance_groups_follow_dapo_eq_11():
    # groups of 4: all correct, all wrong, mixed, one scored + three unscored (fewer than 2 finite)
    r = [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1, math.nan, math.nan, math.nan]
    ids = [g for g in range(4) for _ in range(4)]
    assert zero_variance_groups(r, ids) == {0: True, 1: True, 2: False, 3: True}
    # groups are named by id, not position: interleaved rows and arbitrary ids give the same verdicts
    assert zero_variance_groups([1, 0, 1, 0, 1, 1], [7, 3, 7, 3, 3, 7]) == {7: True, 3: False}


def test_proxy_filter_names_the_first_proxy_that_drops():
    rules = ProxyRules(max_length=5, drop_truncated=True, drop_duplicates=True, format_reward="fmt")
    out = proxy_filter(rules, completions=["a", "a", "b", "toolong", "c", "d"], lengths=[1, 1, 1, 7, 1, 1],
                       finish_reason=["eos", "eos", "eos", "length", "length", "eos"],
                       rewards=[1.0, 1.0, math.nan, 0.0, 1.0, 1.0], group_ids=[0, 0, 0, 1, 1, 1],
                       per_fn={"fmt": [1, 1, 1, 1, 1, 0]})
    assert out == [None, "duplicate", "nonfinite_reward", "too_long", "truncated", "format"]
    assert proxy_filter(ProxyRules(), completions=["x"], lengths=[1], finish_reason=["eos"], rewards=[0.5],
                        group_ids=[0]) == [None]
    # duplicates count within a group only: the same text in two groups is kept in both
    assert proxy_filter(ProxyRules(drop_duplicates=True), completions=["a", "a", "a"], lengths=[1, 1, 1],
                        finish_reason=["eos"] * 3, rewards=[1.0] * 3, group_ids=[5, 9, 5]) == [None, None, "duplicate"]


def test_curriculum_serves_easy_prompts_first_and_raises_the_threshold():
    cur = Curriculum(start=0.3, end=1.0, ramp_steps=10, prior=0.5, bar="steps")
    rows = [{"difficulty": d} for d in (0.9, 0.1, 0.5, 0.2)] + [{}]
    cands = [0, 1, 2, 3, 4]
    assert cur.choose(cands, rows, 3, step=0) == [1, 3, 2]          # easiest first
    assert cur.threshold(0) == 0.3 and math.isclose(cur.threshold(5), 0.65) and cur.threshold(50) == 1.0
    # observed pass rates overrule the prior; the EMA moves halfway
    cur.observe(0, 1.0)                                              # prompt 0 turns out easy
    assert cur.estimate(0, rows[0]) == 0.0
    cur.observe(0, 0.0)
    assert cur.estimate(0, rows[0]) == 0.5
    assert cur.choose(cands, rows, 2, step=0) == [1, 3]
    state = cur.state_dict()
    other = Curriculum(bar="steps")
    other.load_state_dict(state)
    assert other.difficulty == cur.difficulty
