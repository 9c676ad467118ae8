"""A completion cut off right after a backslash (e.g. at `max_new_tokens`, mid `\\boxed`) is scored,
not a reward error."""

from grpokit.rewards._mathcore import boxed_contents, extract_answer
from grpokit.rewards.format import boxed_format


def test_a_trailing_backslash_is_not_an_error():
    assert boxed_contents("So the answer is \\boxed{7}. Then \\") == ["7"]
    assert boxed_contents("\\") == []
    assert boxed_format([""] * 3, ["\\boxed{12} \\", "The sum is \\", "\\boxed{3}"]) == [1.0, 0.0, 1.0]
    assert extract_answer("We get \\boxed{12}. \\").answers == ("12",)
