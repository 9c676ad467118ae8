"""grpokit.rewards.math: the case table (completion, reference, expected, reason), time limits,
never-raises, hedging, the batched reward and the independent checker."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpokit.rewards import REGISTRY
from grpokit.rewards.math import extract_answer, judge_alt, verify
from tests.rewards.clocks import thread_cpu, under_load

T, F = True, False

# (completion, reference, expected, reason)
CASES = [
    # ---- extraction: boxed
    (r"The answer is \boxed{5}.", "5", T, "plain boxed integer"),
    (r"\boxed{5.0}", "5", T, "5.0 equals 5"),
    (r"\boxed{5}", "5.0", T, "5 equals 5.0 (either side)"),
    (r"so \boxed{\frac{1}{2}}", "0.5", T, "fraction vs decimal"),
    (r"\boxed{0.5}", r"\frac{1}{2}", T, "decimal vs fraction"),
    (r"\boxed{\dfrac{3}{4}}", "3/4", T, "dfrac is frac"),
    (r"\boxed{\tfrac{3}{4}}", "0.75", T, "tfrac is frac"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", T, "nested braces inside the box"),
    (r"\boxed{{12}}", "12", T, "doubled braces"),
    (r"\fbox{7}", "7", T, r"\fbox counts as a box"),
    (r"\boxed 9", "9", T, "brace-less \\boxed 9"),
    (r"First \boxed{4}, then checking again: \boxed{4}", "4", T, "the same boxed answer twice is not a hedge"),
    (r"\boxed{ 42 }", "42", T, "whitespace inside the box"),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", T, r"\left/\right dropped"),
    (r"\boxed{\boxed{8}}", "8", T, "a box in a box"),
    (r"We get $x=\boxed{-3}$", "-3", T, "box inside an equation"),
    # ---- extraction: explicit answer statements
    ("The answer is 12.", "12", T, "'answer is' statement, trailing period"),
    ("Answer: 12", "12", T, "'Answer:' statement"),
    ("Reasoning...\n#### 72", "72", T, "GSM8K #### marker"),
    ("**Final Answer:** 3.5", "7/2", T, "bold 'Final Answer:'"),
    ("So the final answer is $\\frac{2}{3}$ of the cake.", r"\frac23", T, "math span after 'answer is'"),
    ("The answer is 15. I hope that helps with 99 other things.", "15", T, "statement cut at the sentence end"),
    ("Answer: 3. Wait, no: the answer is 4.", "4", T, "the last statement wins, even on the same line"),
    ("Answer: 3. Wait, no: the answer is 4.", "3", F, "an earlier statement on the same line is superseded"),
    ("The answer is 1,000,000", "1000000", T, "thousands separators"),
    ("answer: 1{,}234", "1234", T, "LaTeX thousands separator {,}"),
    (r"Answer: 1\,234", "1234", T, r"LaTeX thin-space thousands separator"),
    ("Answer: \u22125", "-5", T, "unicode minus"),
    ("Answer: \u2212\u00bd", "-0.5", T, "unicode minus and vulgar half"),
    ("The answer is: 8 apples", "8", T, "units after the number in words ('8 apples' parses to 8)"),
    ("The answer is 15. I hope that helps with $99$ other things.", "15", T, "a math span in a later sentence is not the answer"),
    ("We can add or subtract the equations. The answer is 3.", "3", T, "'or' in prose before the statement is not a hedge"),
    ("Either way, we get 3", "3", T, "'Either' in prose on the final line, one number"),
    ("The answer is $5$ in either case.", "5", T, "'either' in the statement with a single value"),
    ("The answer is 3. Either way, it works.", "3", T, "'Either way' in the next sentence is prose"),
    ("The answer is $x = 3$, since $3^2 = 9$.", "3", T, "a justifying span after a comma is not a candidate list"),
    ("The divisors are 1, 2, 4 so the sum is 7", "7", T, "a list earlier in the final line is not a hedge"),
    (r"\boxed{3}. Final answer: 3", "3", T, "box and a later statement agree"),
    (r"The answer is \boxed{3}", "3", T, "a statement that holds the box"),
    (r"\boxed{\frac12}. Final answer: 0.5", "1/2", T, "box and later statement agree up to equivalence"),
    ("\\boxed{3}\n\nThe answer is correct because it checks out.", "3", T, "prose 'answer is' after the box is not a second answer"),
    # ---- extraction: last number of the final line
    ("3 + 4 = 7\nso we have 7", "7", T, "last number of the final line"),
    ("We compute 2*3.\nThe result is 6", "6", T, "no marker, final line has the answer"),
    ("Total = 10 - 3 = 7", "7", T, "last number, not the first"),
    ("value is 2.25", "9/4", T, "last number decimal vs fraction"),
    ("It equals \\frac{5}{8}", "0.625", T, "\\frac counts as a number on the final line"),
    # ---- equivalence: numbers
    (r"\boxed{0.3333333}", r"\frac{1}{3}", T, "decimal to 6 places matches 1/3"),
    (r"\boxed{1.50}", "1.5", T, "trailing zero"),
    (r"\boxed{.5}", "0.5", T, "leading dot"),
    (r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", T, "unreduced fraction"),
    (r"\boxed{-\frac{1}{2}}", r"\frac{-1}{2}", T, "sign placement"),
    (r"\boxed{3\pi}", r"3 \pi", T, "spacing before pi"),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", T, "pi fraction forms"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", T, "simplified radical"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", T, "rationalised denominator"),
    (r"\boxed{1e3}", "1000", T, "scientific notation"),
    (r"\boxed{\infty}", r"\infty", T, "infinity"),
    (r"\boxed{-7}", "-7", T, "negative integer"),
    (r"\boxed{3+4i}", "3+4i", T, "complex number"),
    # ---- equivalence: units, degrees, percent, text
    (r"\boxed{5\text{ cm}}", "5", T, r"\text{units} dropped"),
    (r"\boxed{5}", r"5 \text{ cm}", T, "units in the reference dropped"),
    (r"\boxed{12 \text{ dollars}}", r"\$12", T, "currency and unit words"),
    (r"\boxed{30^\circ}", "30", T, "degrees ^\\circ"),
    (r"\boxed{30^{\circ}}", "30", T, "degrees ^{\\circ}"),
    ("The answer is 45\u00b0", "45", T, "unicode degree sign"),
    ("The answer is 45 degrees", "45", T, "the word degrees"),
    (r"\boxed{50\%}", "50", T, "percent sign vs plain number"),
    (r"\boxed{50\%}", "0.5", T, "percent vs fraction of one"),
    (r"\boxed{25\%}", r"25\%", T, "percent both sides"),
    (r"\boxed{\text{Monday}}", r"\text{Monday}", T, "text answer identical"),
    # ---- equivalence: equations and symbols
    (r"\boxed{x = 3}", "3", T, "x = 3 vs 3"),
    (r"\boxed{3}", "x=3", T, "3 vs x = 3"),
    (r"\boxed{y = 2x + 1}", "2x+1", T, "y = ... vs expression"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", T, "symbolic equality after expansion"),
    (r"\boxed{x^2-1}", "(x-1)(x+1)", T, "factored form"),
    (r"\boxed{\frac{x}{2}}", "0.5x", T, "symbolic coefficient"),
    (r"\boxed{2(a+b)}", "2a+2b", T, "distributed"),
    # ---- equivalence: tuples, intervals, sets
    (r"\boxed{(1, 2)}", "(1,2)", T, "tuple spacing"),
    (r"\boxed{(2,3)}", r"\left(2, 3\right)", T, "tuple with \\left/\\right"),
    (r"\boxed{[1, 2]}", "[1,2]", T, "closed interval"),
    (r"\boxed{(1, 2]}", "(1,2]", T, "half-open interval"),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3)", T, "interval to infinity"),
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", T, "set order does not matter"),
    (r"\boxed{2, 1}", "1, 2", T, "bare list read as a set"),
    (r"\boxed{1 \text{ or } 2}", "1, 2", T, "'or' list when the reference is a collection"),
    (r"\boxed{x = 2 \text{ or } x = -2}", r"-2, 2", T, "roots joined by 'or' vs root list"),
    ("The answer is $x = 2$ or $x = -2$.", "-2, 2", T, "math spans joined by 'or' vs root list"),
    (r"The answer is $\{1, 2\}$.", r"\{2,1\}", T, "set against set"),
    (r"\boxed{[0, 1) \cup (1, 2]}", r"[0,1)\cup(1,2]", T, "union of intervals"),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", T, "matrix"),
    # ---- false: wrong values
    (r"\boxed{6}", "5", F, "wrong integer"),
    (r"\boxed{-5}", "5", F, "sign matters"),
    (r"\boxed{0.333}", r"\frac{1}{3}", F, "three decimals is not 1/3"),
    (r"\boxed{3.14}", r"\pi", F, "pi approximation is not pi"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}", F, "different fractions"),
    (r"\boxed{5}", "50", F, "dropped digit"),
    (r"\boxed{1000}", "1,000,001", F, "thousands separator does not hide a difference"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{6}", F, "different radicals"),
    (r"\boxed{x^2}", "y^2", F, "different variable"),
    (r"\boxed{(x+1)^2}", "x^2+1", F, "wrong expansion"),
    (r"\boxed{x = 4}", "3", F, "equation with the wrong value"),
    (r"\boxed{\text{Tuesday}}", r"\text{Monday}", F, "different text answer"),
    (r"\boxed{30^\circ}", "60", F, "wrong angle"),
    (r"\boxed{5\text{ cm}}", "6", F, "units do not rescue a wrong number"),
    (r"\boxed{3+4i}", "3-4i", F, "conjugate"),
    (r"\boxed{5}", "-5", F, "missing minus"),
    (r"\boxed{0.5}", r"\frac{1}{4}", F, "decimal vs a different fraction"),
    (r"\boxed{50\%}", "5", F, "percent is not off by a factor of ten"),
    (r"\boxed{1,001}", "1000", F, "grouped digits of a different number"),
    (r"\boxed{x+1}", "x-1", F, "sign inside an expression"),
    (r"\boxed{2x}", "x^2", F, "product vs power"),
    (r"\boxed{1.41}", r"\sqrt{2}", F, "two-decimal approximation of a radical"),
    (r"\boxed{3.0001}", "3", F, "differs in the fourth decimal"),
    (r"\boxed{0.3}", r"\frac{1}{3}", F, "one decimal is not 1/3"),
    (r"\boxed{e}", r"\pi", F, "different constants"),
    (r"\boxed{A}", "B", F, "different multiple-choice letter"),
    ("The answer is 7", "8", F, "explicit statement with the wrong value"),
    ("#### 71", "72", F, "GSM8K marker with the wrong value"),
    ("so we get 7\nThe end.", "7", F, "the final line has no number: no answer extracted"),
    (r"\boxed{\infty}", r"-\infty", F, "sign of infinity"),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3)", F, "closed end vs open end at 3"),
    # ---- false: tuples, intervals, sets
    (r"\boxed{(1, 2)}", "[1,2]", F, "open vs closed interval"),
    (r"\boxed{[1, 2)}", "[1,2]", F, "half-open vs closed"),
    (r"\boxed{(1, 2]}", "(1,2)", F, "half-open vs open"),
    (r"\boxed{(2, 1)}", "(1,2)", F, "tuple order matters"),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", F, "missing set element"),
    (r"\boxed{1, 2, 3}", "1, 2", F, "extra list element"),
    (r"\boxed{(1,2,3)}", "(1,2)", F, "tuple length"),
    (r"\boxed{(2,1)}", r"\{1,2\}", F, "a tuple is not a set (math-verify sorts both)"),
    (r"\boxed{(1,2)}", r"\{1,2\}", F, "an ordered pair is not a set, even in set order"),
    (r"\boxed{\{1,2\}}", "(1,2)", F, "a set is not an ordered pair"),
    # ---- false: hedging
    (r"It is \boxed{3} or maybe \boxed{4}", "3", F, "two different boxed answers: hedge"),
    (r"\boxed{4} ... no wait \boxed{3}", "3", F, "hedge even when the last box is right"),
    (r"\boxed{1}\boxed{2}\boxed{3}\boxed{4}\boxed{5}", "3", F, "box spraying"),
    ("The answer is 3 or 4.", "3", F, "candidate list in the final statement"),
    ("The answer is either 3 or 4", "4", F, "'either ... or' hedge"),
    (r"\boxed{3 \text{ or } 4}", "3", F, "hedge inside one box"),
    ("It could be 3, or 4", "4", F, "final line lists candidates (last-number fallback)"),
    (r"\boxed{3, 4}", "3", F, "a list is not the single answer"),
    ("The answer is 1, 2, 3, 4, 5, 6", "4", F, "candidate list without 'or'"),
    ("The answer is $3$ or $4$.", "3", F, "'or' between math spans (the hedge is read before cleaning)"),
    ("Answer: $3$ or $4$", "3", F, "'Answer:' with math spans joined by 'or'"),
    ("**Final Answer:** $3$ or $4$", "3", F, "bold 'Final Answer:' with math spans joined by 'or'"),
    ("The answer is either $3$ or $4$.", "4", F, "'either ... or' between math spans"),
    ("The answer is $3$ (or $4$ if rounding).", "3", F, "an alternative in parentheses"),
    ("Answer: $3$, $4$", "3", F, "math spans listed with a comma"),
    ("Answer: $3$ and $4$", "4", F, "math spans listed with 'and'"),
    ("The answer is 3, 4.", "3", F, "plain two-candidate list after 'answer is'"),
    ("The answer is 3. Or 4.", "3", F, "an 'Or ...' sentence right after the statement"),
    ("So it is 3 or 4", "3", F, "'3 or 4' in the final line, first candidate right"),
    ("So it is 3 or 4", "4", F, "'3 or 4' in the final line, last candidate right"),
    ("It is $3$ or possibly $4$", "4", F, "'or possibly' in the final line"),
    ("The candidates are 3, 4", "4", F, "the final line ends in a comma list (last-number fallback)"),
    (r"\boxed{3}. Final answer: 4", "3", F, "box and a later statement disagree (box right)"),
    (r"\boxed{3}. Final answer: 4", "4", F, "box and a later statement disagree (statement right)"),
    (r"\boxed{3}. Final answer: $3$ or $4$", "3", F, "the statement after the box hedges"),
    (r"\boxed{A}. The answer is B.", "A", F, "a choice letter stated after the box is a second answer"),
    (r"\boxed{3}. The final answer is therefore 4.", "3", F, "a filler word ('therefore') does not hide the value after it"),
    (r"\boxed{3}. The answer is, thus, $4$.", "3", F, "fillers between commas before a math span"),
    (r"\boxed{3}. The answer is definitely not 3 but 4.", "3", F, "prose first: every number it states is an answer"),
    (r"\boxed{B}. Final answer: (C)", "B", F, "a choice letter in parentheses after the box"),
    (r"\boxed{B}. On reflection the answer is clearly D, not B.", "B", F, "filler, then a different choice letter"),
    (r"\boxed{A}. The answer is A, B", "A", F, "a list of choice letters after the box hedges"),
    (r"\boxed{3}. The answer is simply **4**.", "3", F, "filler then a bold value"),
    (r"\boxed{3}. The answer is 3.", "3", T, "a restatement of the same value after the box"),
    (r"\boxed{6}. The answer is correct because 2 \times 3 = 6.", "6", T, "a check after the box states no second answer"),
    (r"\boxed{6}. This answer is consistent with the check 2 + 4 = 6.", "6", T, "prose with a worked check is not a value"),
    (r"\boxed{6}. The final answer is verified: plugging in x = 2 gives 6.", "6", T, "a verification sentence is not a value"),
    (r"\boxed{3}. The answer is not 3 but rather 4.", "3", F, "'but rather' corrects the box"),
    (r"\boxed{3}. The answer is, instead, $4$.", "3", F, "'instead' corrects the box"),
    (r"\boxed{A}. The answer is (A).", "A", T, "a restated choice letter in parentheses"),
    (r"\boxed{3}. This answer is consistent with the check.", "3", T, "prose without any value after the box"),
    (r"The answer is \boxed{3}.", "3", T, "a statement that holds the box, then a full stop"),
    (r"\boxed{3}. The answer is therefore 3.", "3", T, "a restatement behind a filler word"),
    (r"\boxed{C}. The answer is C because the other options fail.", "C", T, "a choice letter with its reason"),
    ("The answer is therefore 4.", "4", T, "a filler word before the value of a statement without a box"),
    ("The answer is (B).", "B", T, "a choice letter in parentheses is the letter"),
    # ---- false: a numeric reference answered by an expression that evaluates to it (strict_numbers)
    (r"\boxed{21 + 14}", "35", F, "the question's own sum copied into the box"),
    ("What is 21 + 14? The answer is 21 + 14.", "35", F, "the question restated after 'answer is'"),
    (r"\boxed{2^{10}}", "1024", F, "an unevaluated power"),
    (r"\boxed{\sqrt{16}}", "4", F, "an unevaluated root"),
    (r"\boxed{10^3}", "1000", F, "a power of ten for an integer"),
    (r"\boxed{e^{0}}", "1", F, "e^0 for 1"),
    (r"\boxed{\sin^2 x + \cos^2 x}", "1", F, "an identity for 1"),
    (r"\boxed{\frac{70}{2}}", "35", F, "a fraction for an integer"),
    (r"\boxed{7 \times 5}", "35", F, "an unevaluated product"),
    (r"\boxed{0 - 5}", "-5", F, "a difference for a negative number"),
    (r"\boxed{21 + 14 = 35}", "35", T, "a worked sum that ends in the value"),
    (r"\boxed{35.0}", "35", T, "a decimal for an integer is still one number"),
    (r"\boxed{\{35\}}", "35", F, "a set is not the number"),
    # ---- false: extraction failures and junk
    ("", "5", F, "empty completion"),
    ("I don't know.", "5", F, "no answer at all"),
    (r"\boxed{}", "5", F, "empty box"),
    (r"The result: \boxed{5", "5", T, "unclosed box (truncated) falls back to the last number of the final line"),
    ("The answer is", "5", F, "marker with nothing after it"),
    ("Answer: 5\nWait, let me recompute.\nActually it is 6", "5", T, "an explicit answer statement beats later text (a known hole)"),
    ("5 apples and 6 pears", "5", F, "last number of the final line is 6"),
    (r"\boxed{10^{10^{10^{10}}}}", "1", F, "pathological tower: time limit, False"),
    ("\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", "2", F, "deep nesting is not 2"),
    (r"\boxed{\frac{1}{0}}", "1", F, "division by zero is not 1"),
    (r"\boxed{x}", "5", F, "a bare symbol is not a number"),
    ("answer: " + "9" * 3000, "9", F, "absurdly long answer rejected"),
    ("The answer is 5.", None, None, "no reference: cannot be scored"),
]


# Equivalence alone (strict_numbers=False): what the cases above refuse as unevaluated is equal,
# for both checkers (the second one cannot read `\\sin^2 x`: third field False).
EQUIVALENT_ONLY = [
    (r"\boxed{21 + 14}", "35", True), (r"\boxed{2^{10}}", "1024", True), (r"\boxed{\sqrt{16}}", "4", True),
    (r"\boxed{10^3}", "1000", True), (r"\boxed{e^{0}}", "1", True), (r"\boxed{\sin^2 x + \cos^2 x}", "1", False),
    (r"\boxed{\frac{70}{2}}", "35", True), (r"\boxed{7 \times 5}", "35", True),
]


@pytest.mark.parametrize("completion,reference,alt_reads", EQUIVALENT_ONLY)
def test_strict_numbers_refuses_what_plain_equivalence_accepts_in_both_checkers(completion, reference, alt_reads):
    assert verify(completion, reference) is False
    assert verify(completion, reference, strict_numbers=False) is True
    assert judge_alt(completion, reference) is False
    assert judge_alt(completion, reference, strict_numbers=False) is alt_reads


def test_the_second_checker_still_takes_numbers_written_as_numbers():
    assert judge_alt(r"\boxed{35}", "35") is True
    assert judge_alt(r"\boxed{\frac{1}{2}}", "0.5") is True
    assert judge_alt(r"\boxed{35.0}", "35") is True
    assert judge_alt(r"\boxed{\frac{70}{2}}", r"\frac{70}{2}") is True


def test_strict_numbers_is_a_reward_argument_from_config():
    from grpokit.config import load_config
    from grpokit.rewards import RewardSet

    for args, expected in (("{}", [0.0, 1.0]), ("{strict_numbers: false}", [1.0, 1.0])):
        cfg = load_config(None, [f"rewards=[{{name: math_accuracy, args: {args}}}]"])
        rs = RewardSet.from_specs([r.model_dump() for r in cfg.rewards])
        out = rs.score(["What is 21 + 14?"] * 2, [r"\boxed{21 + 14}", r"\boxed{35}"], {"answer": ["35", "35"]})
        assert out.per_fn["math_accuracy"] == expected, args


@pytest.mark.parametrize("completion,reference,expected,reason", CASES, ids=[c[3][:60] for c in CASES])
def test_case_table(completion, reference, expected, reason):
    if expected is None:
        from grpokit.rewards.math import judge

        assert judge(completion, reference) is None, reason
        return
    assert verify(completion, reference) is expected, reason


def test_table_is_large_and_balanced():
    n_true = sum(1 for c in CASES if c[2] is True)
    n_false = sum(1 for c in CASES if c[2] is False)
    assert len(CASES) >= 120 and n_true >= 50 and n_false >= 50, (len(CASES), n_true, n_false)


def test_pathological_input_returns_false_within_two_seconds():
    """2 s on a quiet machine (the checker is killed at 1.5 s); the wall-clock bound allows for a
    loaded one. Unkilled, these answers take minutes."""
    for bomb in (r"\boxed{10^{10^{10^{10}}}}", r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{(10^{10^{8}})!}"):
        # a checker process is up and idle (its start-up is not part of the limit); 1.0 vs 1 is
        # not identical text, so it really goes to a checker
        assert verify(r"\boxed{1.0}", "1") is True
        t0 = time.monotonic()
        assert verify(bomb, "7", strict_numbers=False) is False  # not refused by its form: timed
        assert time.monotonic() - t0 < under_load(2.0), bomb
    assert verify(r"\boxed{2.0}", "2") is True  # and the pool recovered


def test_a_checker_stuck_in_c_code_is_killed_within_two_seconds(monkeypatch, tmp_path):
    """The worst case: the checker ignores its own timer (as in C code), so the parent must kill
    it. The default budget leaves margin for the kill under the issue's 2 s (on a quiet machine;
    the bound allows for a loaded one, the stub would sleep for an hour)."""
    from grpokit.rewards import math as M
    from grpokit.rewards._workers import WorkerPool

    stuck = tmp_path / "stuck_checker.py"
    stuck.write_text("import sys, time\nprint('ready', flush=True)\nfor line in sys.stdin:\n    time.sleep(3600)\n")
    pool = WorkerPool(str(stuck), size=1)
    monkeypatch.setattr(M, "_pool", [pool])
    try:
        t0 = time.monotonic()  # (the stub itself starts in milliseconds)
        assert verify(r"\boxed{2.0}", "2") is False  # a timeout scores 0
        assert time.monotonic() - t0 < under_load(2.0)
    finally:
        pool.close()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("\\{}^_()[],.$=-+0123456789xboxedfrac ")), max_size=60), st.text(max_size=20))
def test_never_raises(completion, reference):
    assert verify(completion, reference, timeout_s=1.0) in (True, False)


def test_non_string_inputs_do_not_raise():
    assert verify(None, "5") is False  # type: ignore[arg-type]
    assert verify(r"\boxed{5}", 5) is True  # numeric reference
    assert verify(r"\boxed{5}", "\\boxed{5}") is True  # reference given as a boxed solution
    assert verify("#### 5", "The solution... #### 5") is True  # GSM8K-style reference


def test_extraction_sources():
    assert extract_answer(r"x \boxed{1} y \boxed{2}").answers == ("1", "2")
    assert extract_answer("Answer: 7").source == "marker"
    assert extract_answer("so 3 then 4").source == "last_number"
    assert extract_answer("no numbers here").source == "none"
    assert extract_answer("The answer is 3 or 4").hedged
    assert extract_answer("Answer: $3$ or $4$").hedged  # seen in the raw statement, not in "3"
    assert extract_answer(r"\boxed{3}. Final answer: 4").answers == ("3", "4")
    assert extract_answer(r"The answer is \boxed{3}").answers == ("3",)


def test_reward_batch_and_none_for_missing_reference():
    fn = REGISTRY["math_accuracy"]
    out = fn(["p"] * 4, [r"\boxed{2}", r"\boxed{3}", "nothing", r"\boxed{2}"], answer=["2", "2", "2", None],
             completion_length=[3] * 4, group_id=[0] * 4, finish_reason=["eos"] * 4, extra_column=[1, 2, 3, 4])
    assert out == [1.0, 0.0, 0.0, None]


def test_reward_answer_column_is_configurable():
    fn = REGISTRY["math_accuracy"]
    assert fn(["p"], [r"\boxed{9}"], answer_column="solution", solution=["9"]) == [1.0]
    with pytest.raises(KeyError):
        fn(["p"], [r"\boxed{9}"], answer_column="solution", answer=["9"])


# The independent checker agrees with the primary on unambiguous cases (the ones where the
# extraction rules coincide), and disagrees on a hedge, which is what cross-checking is for.
ALT_AGREE = [c for c in CASES if c[2] is not None and c[3] in {
    "plain boxed integer", "5.0 equals 5", "fraction vs decimal", "dfrac is frac", "nested braces inside the box",
    "'Answer:' statement", "GSM8K #### marker", "thousands separators", "unicode minus", "degrees ^\\circ",
    "percent vs fraction of one", "x = 3 vs 3", "symbolic equality after expansion", "factored form",
    "set order does not matter", "open vs closed interval", "tuple order matters", "wrong integer", "sign matters",
    "three decimals is not 1/3", "different variable", "half-open vs open", "missing set element",
    "rationalised denominator", "pi approximation is not pi", "bare list read as a set",
}]


@pytest.mark.parametrize("completion,reference,expected,reason", ALT_AGREE, ids=[c[3][:60] for c in ALT_AGREE])
def test_alt_checker_agrees_on_clear_cases(completion, reference, expected, reason):
    assert judge_alt(completion, reference) is expected, reason


def test_alt_checker_is_independent_on_hedges():
    hedge = r"It is \boxed{4} or maybe \boxed{3}"
    assert verify(hedge, "3") is False
    assert judge_alt(hedge, "3") is True  # last box only: the disagreement CrossCheck reports


def test_a_checker_crash_scores_zero_and_the_pool_recovers(monkeypatch):
    import os
    import signal

    from grpokit.rewards import _workers

    assert verify(r"\boxed{1.0}", "1") is True  # a worker is up
    real_call = _workers._Worker.call

    def crash_then_call(self, req, timeout_s):
        os.kill(self.proc.pid, signal.SIGKILL)  # as if the input had crashed sympy
        return real_call(self, req, timeout_s)

    monkeypatch.setattr(_workers._Worker, "call", crash_then_call)
    assert REGISTRY["math_accuracy"](["p"], [r"\boxed{2.0}"], answer=["2"]) == [0.0]  # not None: no escape hatch
    monkeypatch.setattr(_workers._Worker, "call", real_call)
    assert verify(r"\boxed{2.0}", "2") is True


def test_no_checker_means_cannot_score(monkeypatch, tmp_path):
    from grpokit.rewards import math as M
    from grpokit.rewards._workers import WorkerPool

    broken = tmp_path / "broken_checker.py"
    broken.write_text("raise SystemExit(1)\n")
    pool = WorkerPool(str(broken), size=1)
    monkeypatch.setattr(M, "_pool", [pool])
    assert REGISTRY["math_accuracy"](["p", "p"], [r"\boxed{2.0}", r"\boxed{2}"], answer=["2", "2"]) == [None, 1.0]
    pool.close()


@pytest.mark.parametrize("text", [
    "The answer is " + "\\(" * 100_000,  # was quadratic in the math-span regex (minutes)
    "The answer is " + "$a" * 100_000,
    "\\boxed{" * 30_000,
    "{" * 200_000,
    "1 or " * 40_000,
    "\\" * 200_000,
], ids=["open-parens", "dollars", "open-boxes", "braces", "or-list", "backslashes"])
def test_huge_adversarial_completions_stay_within_the_limit(text):
    # the trainer's own work (extraction: a quadratic regex took minutes of it) in CPU time of this
    # thread, under 0.1 s here; the checkers' part is cut off at their limit (wall time)
    t0, cpu0 = time.monotonic(), thread_cpu()
    assert verify(text, "1") is False
    judge_alt(text, "1")  # (no hedging rule there: "1 or 1 or ..." ends in 1)
    assert thread_cpu() - cpu0 < 2.0
    assert time.monotonic() - t0 < under_load(5.0)


def test_a_batch_of_pathological_answers_scores_zero_not_none_under_the_default_budget(monkeypatch):
    """The composer's per-call budget covers the whole batch; over it, every sample would score
    None (advantage 0: no penalty). math_accuracy bounds each answer itself, so by default it is
    not put under that budget: a batch of answers that all hit the per-answer limit scores 0s, even
    when the batch takes longer than the default budget (patched tiny here)."""
    from grpokit.config import load_config
    from grpokit.rewards import RewardSet, compose

    monkeypatch.setattr(compose, "DEFAULT_TIMEOUT_S", 0.2)
    assert verify(r"\boxed{1.0}", "1") is True  # a checker is up (start-up is not the point here)
    bombs = [r"\boxed{10^{10^{10^{10}}}}", r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{(10^{10^{8}})!}",
             r"\boxed{10^{10^{10^{10}}}+1}"]
    cfg = load_config(None, ["rewards=[{name: math_accuracy, args: {timeout_s: 0.6, strict_numbers: false}}]"])
    rs = RewardSet.from_specs([r.model_dump() for r in cfg.rewards])  # as the trainer builds it
    t0 = time.monotonic()
    out = rs.score(["p"] * 4, bombs, {"answer": ["7"] * 4})
    took = time.monotonic() - t0
    assert took > 0.2  # longer than the (patched) default budget: the budget really was not applied
    assert out.per_fn["math_accuracy"] == [0.0] * 4  # a timeout scores 0, never None
    assert out.metrics["reward/math_accuracy/errors"] == 0.0 and out.metrics["reward/total_nan_frac"] == 0.0
    assert rs.specs[0].timeout_s is None


def test_a_timed_out_call_does_not_wait_for_the_kill_or_the_respawn(monkeypatch, tmp_path):
    """The caller returns when its time is up: reaping the killed checker (slow when it holds
    gigabytes, or on a loaded machine) and starting the replacement happen off its path. Both are
    held until the call has returned, so a caller that waited for either could not return before
    the hold gave up (30 s): no wall-clock bound, which a loaded machine would stretch."""
    import threading

    from grpokit.rewards import _workers
    from grpokit.rewards import math as M

    stuck = tmp_path / "stuck_checker.py"
    stuck.write_text("import sys, time\nprint('ready', flush=True)\nfor line in sys.stdin:\n    time.sleep(3600)\n")
    real_kill, real_init = _workers._Worker.kill, _workers._Worker.__init__
    hold, reaped, respawned = threading.Event(), threading.Event(), threading.Event()

    def held_kill(self):  # as if the killed process took long to exit
        hold.wait(30)
        real_kill(self)
        reaped.set()

    def held_init(self, script):  # as if the replacement took long to start
        hold.wait(30)
        real_init(self, script)
        respawned.set()

    def join_respawns():
        for t in threading.enumerate():
            if t.name == "checker-respawn":
                t.join(60)

    pool = _workers.WorkerPool(str(stuck), size=1)
    monkeypatch.setattr(M, "_pool", [pool])
    try:
        assert verify(r"\boxed{2.0}", "2", timeout_s=0.3) is False  # the stub is up (and was killed)
        join_respawns()  # that kill's reaping and respawn are done, unheld
        monkeypatch.setattr(_workers._Worker, "kill", held_kill)
        monkeypatch.setattr(_workers._Worker, "__init__", held_init)
        assert verify(r"\boxed{2.0}", "2", timeout_s=0.3) is False
        assert not reaped.is_set() and not respawned.is_set()  # returned while both were still held
    finally:
        hold.set()
        join_respawns()  # let the background respawn finish before the pool is closed
        monkeypatch.setattr(_workers._Worker, "kill", real_kill)
        monkeypatch.setattr(_workers._Worker, "__init__", real_init)
        pool.close()
    assert reaped.is_set() and respawned.is_set()  # and both did happen, off the caller's path


def test_a_closed_pool_leaves_no_checker_behind(tmp_path):
    """close() while a call is in flight: the worker that comes back is killed, not kept idle; a
    call after close() fails at once instead of starting a new checker (nothing outlives close)."""
    import threading

    from grpokit.rewards._workers import WorkerError, WorkerPool

    slow = tmp_path / "slow_checker.py"
    slow.write_text("import json, sys, time\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
                    "    req = json.loads(line)\n    time.sleep(0.5)\n"
                    "    print(json.dumps({'id': req['id'], 'ok': True}), flush=True)\n")
    pool = WorkerPool(str(slow), size=1)
    pool.call({"x": 1}, 5.0)                                   # start the one worker
    worker = pool.idle[0]
    out = []
    t = threading.Thread(target=lambda: out.append(pool.call({"x": 2}, 5.0)))
    t.start()
    time.sleep(0.2)
    pool.close()                                               # the call is in flight
    t.join(5)
    assert out and out[0] is not None                          # the call itself finished
    assert pool.idle == [] and pool.count == 0
    worker.proc.wait(timeout=5)                                # killed on its way back
    with pytest.raises(WorkerError, match="closed"):
        pool.call({"x": 3}, 5.0)
