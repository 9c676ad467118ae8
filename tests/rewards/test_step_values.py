"""step_values: credit for stating a problem's known intermediate results, not for listing numbers."""

import pytest

from grpokit.rewards import get
from grpokit.rewards.math import stated_values, step_credit


def score(completions, steps, **kw):
    return get("step_values")(["q"] * len(completions), completions, steps=steps, **kw)


@pytest.mark.parametrize("text, want", [
    ("24 - 5 = 19, then 19 + 19 = 38. \\boxed{38}", [19.0, 38.0]),
    ("2 - 4 = -2 and -2 + 25 = 23", [-2.0, 23.0]),
    ("total = 1,200 apples", [1200.0]),
    ("x = 18 * 2 = 36", [36.0]),           # 18 starts an expression: not a result
    ("9+9=18.", [18.0]),                   # the sentence's full stop is not a decimal
    ("= 2.5 kg", [2.5]),
    ("no equation here: 19", []),
])
def test_stated_values(text, want):
    assert stated_values(text) == want


def test_credit_for_the_stated_step_only():
    got = score(["24 - 5 = 19, then 19 + 19 = 38. \\boxed{38}",     # the step, right answer
                 "24 - 5 = 19, so 19 + 19 = 40. \\boxed{40}",       # the step, wrong answer
                 "24 - 5 + 19 equals 38. \\boxed{38}",              # right answer, no step shown
                 "19 is the first part. \\boxed{38}",               # 19 not stated as a result
                 "24 - 5 = 18, 18 + 19 = 37"],                       # a wrong step
                [["19"]] * 5)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_a_step_given_as_the_final_answer_is_a_stop_halfway():
    fn = get("step_values")
    texts = ["25 - 14 = 11, \\boxed{11}",                 # stops at the step: no credit
             "25 - 14 = 11, 11 + 24 = 35. \\boxed{35}",   # goes on: credit
             "25 - 14 = 11, 11 + 24 = 36. \\boxed{36}"]   # goes on, wrong sum: credit for the step
    assert fn(["q"] * 3, texts, steps=[["11"]] * 3, answer=["35"] * 3) == [0.0, 1.0, 1.0]
    assert fn(["q"], ["25 - 14 = 11, \\boxed{11}"], steps=[["11"]]) == [0.0]        # no answer column
    assert fn(["q"], ["5 - 3 = 2, \\boxed{2}"], steps=[["2"]], answer=["2"]) == [1.0]  # the step is the answer


def test_partial_credit_over_several_steps_and_step_formats():
    text = "48 / 2 = 24. 24 + 10 = 34. \\boxed{34}"
    assert score([text] * 4, [[24, 30], "24;30", ["24", "34"], (24,)], answer=["34"] * 4) == [0.5, 0.5, 1.0, 1.0]
    assert score(["9 + 9 = 18; 18 + 22 = 40"], [[18.0]]) == [1.0]
    assert score(["3 * 400 = 1,200, and 100 more: \\boxed{1300}"], [["1200"]]) == [1.0]


def test_rows_without_steps_score_zero_for_the_whole_group():
    assert score(["24 - 5 = 19", "anything"], [[], None]) == [0.0, 0.0]


def test_listing_numbers_collects_nothing():
    spam = " ".join(f"= {v}" for v in range(10, 30))
    assert score([spam], [["19"]]) == [0.0]
    # up to len(steps) + 1 + slack distinct results are allowed: the step, the answer and restatements
    ok = "24 - 5 = 19. 19 + 19 = 38. So = 38. Check: 38 - 19 = 19. = 20"
    assert score([ok], [["19"]]) == [1.0]
    assert score([ok], [["19"]], slack=0) == [0.0]
    assert step_credit(ok, [19.0], slack=1) == 1.0 and step_credit(ok, []) == 0.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="row 1: step 'x' is not a number"):
        score(["a", "b"], [["1"], ["x"]])
    with pytest.raises(ValueError, match="not finite"):
        score(["a"], [["nan"]])
    with pytest.raises(ValueError, match="must be a list"):
        score(["a"], [{"a": 1}])
    with pytest.raises(ValueError, match="slack"):
        score(["a"], [["1"]], slack=-1)
    with pytest.raises(KeyError, match="steps"):
        get("step_values")(["q"], ["a"], answer=["1"])


def test_the_column_is_checked_at_start():
    """A dataset without the column is refused when the run is built, as for the built-ins."""
    from grpokit.errors import ConfigError
    from grpokit.rewards import check_columns

    spec = {"name": "step_values", "args": {}}
    check_columns([spec], [{"prompt": "p", "steps": ["1"]}], "train")
    with pytest.raises(ConfigError, match="steps"):
        check_columns([spec], [{"prompt": "p", "answer": "1"}], "train")
    with pytest.raises(ConfigError, match="partials"):
        check_columns([{"name": "step_values", "args": {"steps_column": "partials"}}],
                      [{"prompt": "p", "steps": ["1"]}], "train")
