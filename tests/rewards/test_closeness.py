"""math_closeness: partial credit by distance to a numeric reference, read as math_accuracy reads."""

import math

import pytest

from grpokit.rewards import get
from grpokit.rewards.math import closeness


@pytest.mark.parametrize("text, ref, want", [
    ("So the answer is \\boxed{12}.", "12", 1.0),
    ("\\boxed{13}", "12", 0.5),
    ("\\boxed{9}", "12", 0.25),
    ("\\boxed{-3}", "12", 1 / 16),
    ("\\boxed{12.5}", 12, 1 / 1.5),
    ("\\boxed{x = 11}", "12", 0.5),
    ("\\boxed{12 apples}", "12", 1.0),
    ("\\boxed{1,200}", "1200", 1.0),
    ("15 - 3 = 12", "12", 1.0),               # no box: the last number of the final line
    ("The answer is 14.", "#### 12", 1 / 3),   # GSM8K-style reference
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),     # a fraction answers a decimal or a fraction
    ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac12}", "0.75", 1 / 1.25),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
])
def test_distance(text, ref, want):
    assert math.isclose(closeness(text, ref), want)


@pytest.mark.parametrize("text", [
    "\\boxed{10 + 2}",              # an expression that evaluates to it: not an answer (strict_numbers)
    "\\boxed{\\frac{24}{2}}",       # a fraction for an integer
    "\\boxed{12} or \\boxed{13}",   # two different answers: a hedge
    "The answer is 12 or 13",
    "I do not know.",
    "",
])
def test_no_single_number_scores_zero(text):
    assert closeness(text, "12") == 0.0


def test_reference_not_a_number_is_unscored():
    assert closeness("\\boxed{5}", "x + 1") is None
    assert closeness("\\boxed{5}", None) is None
    assert closeness("\\boxed{5}", "\\frac{1}{0}") is None


def test_scale_and_ordering():
    near, far = closeness("\\boxed{110}", "100", scale=10.0), closeness("\\boxed{130}", "100", scale=10.0)
    assert math.isclose(near, 0.5) and math.isclose(far, 0.25)
    # the exact answer always scores most, by a margin
    scores = [closeness(f"\\boxed{{{x}}}", "20") for x in range(10, 31)]
    assert max(scores) == scores[10] == 1.0 and sorted(scores)[-2] == 0.5


def test_registered_with_its_column_and_bad_scale():
    fn = get("math_closeness")
    out = fn([""] * 3, ["\\boxed{7}", "\\boxed{8}", "\\boxed{7}"], answer=["7", "7", "pi"])
    assert out[:2] == [1.0, 0.5] and out[2] is None
    with pytest.raises(ValueError, match="scale"):
        fn([""], ["\\boxed{7}"], answer=["7"], scale=0)
