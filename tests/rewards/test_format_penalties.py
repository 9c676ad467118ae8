"""Format rewards, penalties and the demo rewards: golden values worked out in comments, plus
properties that every registered reward must have."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.rewards import REGISTRY, is_truncated
from grpokit.rewards.penalties import repetition_rate, soft_overlong_penalty


def call(name, completions, **cols):
    return REGISTRY[name](["p"] * len(completions), completions, **cols)


# --------------------------------------------------------------------------- think/answer format

GOOD = "<think>2 + 2 is 4</think>\n<answer>4</answer>"


@pytest.mark.parametrize("text,expected,reason", [
    (GOOD, 1.0, "one real think, one real answer"),
    ("  " + GOOD + "\n", 1.0, "surrounding whitespace is fine"),
    ("<think></think><answer></answer>", 0.0, "the seed's tag-only hack"),
    ("<think>   </think><answer>\n</answer>", 0.0, "whitespace-only tags"),
    ("<think>...</think><answer>4</answer>", 0.0, "punctuation is not reasoning"),
    ("<think><b></b></think><answer>4</answer>", 0.0, "markup is not reasoning"),
    ("<think>x</think><answer>4</answer><answer>4</answer>", 0.0, "repeated answer tag"),
    ("<think>x</think><think>y</think><answer>4</answer>", 0.0, "repeated think tag"),
    ("<answer>4</answer><think>x</think>", 0.0, "wrong order"),
    ("Sure! " + GOOD, 0.0, "text before the tags"),
    (GOOD + " Hope this helps", 0.0, "text after the tags"),
    ("<think>x</think>", 0.0, "no answer block"),
    ("4", 0.0, "no tags at all"),
    ("<think>x<answer>4</answer></think>", 0.0, "answer nested inside think"),
])
def test_think_answer_format(text, expected, reason):
    assert call("think_answer_format", [text]) == [expected], reason


def test_think_in_prompt_variant():
    assert call("think_answer_format", ["reasoning here</think><answer>4</answer>"], think_in_prompt=True) == [1.0]
    assert call("think_answer_format", ["<think>r</think><answer>4</answer>"], think_in_prompt=True) == [0.0]
    assert call("think_answer_format", ["</think><answer>4</answer>"], think_in_prompt=True) == [0.0]


def test_custom_tags():
    assert call("think_answer_format", ["<reason>ok</reason><final>7</final>"], think_tag="reason", answer_tag="final") == [1.0]


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{4}", 1.0), (r"\boxed{4} and \boxed{4}", 0.0), (r"\boxed{}", 0.0), (r"\boxed{ }", 0.0),
    (r"\boxed{4", 0.0), ("4", 0.0), (r"\boxed{\frac{1}{2}}", 1.0),
])
def test_boxed_format(text, expected):
    assert call("boxed_format", [text]) == [expected]


@pytest.mark.parametrize("text,expected", [
    ("```python\ndef f(x):\n    return x\n```", 1.0), ("```python\npass\n```", 0.0), ("```python\nimport os\n```", 0.0),
    ("```python\n'''just a docstring'''\n```", 0.0), ("```python\ndef f(:\n```", 0.0), ("no code", 0.0),
])
def test_code_format(text, expected):
    assert call("code_format", [text]) == [expected]


def test_format_violation():
    assert call("format_violation", [GOOD, "<think></think><answer></answer>"]) == [0.0, -1.0]
    assert call("format_violation", [r"\boxed{1}", "1"], format="boxed", penalty=0.5) == [0.0, -0.5]
    with pytest.raises(ValueError):
        call("format_violation", ["x"], format="xml")


# --------------------------------------------------------------------------- soft overlong (DAPO Eq. 13; docs/rewards.md)


@pytest.mark.parametrize("length,expected", [
    (0, 0.0),
    (16384, 0.0),       # |y| = L_max - L_cache: still free
    (16385, -1 / 4096),  # first token into the cache
    (18432, -0.5),      # (16384 - 18432) / 4096 = -0.5
    (20480, -1.0),      # |y| = L_max
    (20481, -1.0),      # beyond L_max
])
def test_soft_overlong_dapo_paper_setting(length, expected):
    # DAPO: expected max 16,384 + cache 4,096 => L_max = 20,480.
    assert soft_overlong_penalty(length, 20480, 4096) == pytest.approx(expected)
    assert call("soft_overlong", ["y"], max_len=20480, cache=4096, completion_length=[length]) == [pytest.approx(expected)]


def test_soft_overlong_defaults_to_max_new_tokens_and_20_percent_cache():
    # max_new_tokens 100 -> cache 20, free up to 80: lengths 80, 90, 100 -> 0, -0.5, -1
    out = call("soft_overlong", ["a", "b", "c"], completion_length=[80, 90, 100], max_new_tokens=[100] * 3)
    assert out == [0.0, -0.5, -1.0]


def test_soft_overlong_matches_verl_form():
    # verl: exceed = L - (max_len - cache); reward = min(-exceed / cache * factor, 0), for L <= max_len
    for L in range(0, 65):
        verl = min(-(L - (64 - 16)) / 16 * 2.0, 0.0)
        assert soft_overlong_penalty(L, 64, 16, penalty_factor=2.0) == pytest.approx(verl)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 5000), st.integers(0, 6000), st.integers(0, 6000))
def test_soft_overlong_bounded_and_monotone(max_len, a, b):
    cache = max(1, max_len // 5)
    pa, pb = soft_overlong_penalty(a, max_len, cache), soft_overlong_penalty(b, max_len, cache)
    assert -1.0 <= pa <= 0.0
    if a <= b:
        assert pa >= pb


def test_soft_overlong_rejects_bad_cache():
    with pytest.raises(ValueError):
        soft_overlong_penalty(10, 64, 0)


# --------------------------------------------------------------------------- repetition, length


def test_ngram_repetition_golden():
    # "a b c d a b c d": 4-grams abcd, bcda, cdab, dabc, abcd -> 5 grams, 4 distinct -> 1 - 4/5 = 0.2
    assert repetition_rate("a b c d a b c d", 4) == pytest.approx(0.2)
    assert call("ngram_repetition", ["a b c d a b c d"]) == [pytest.approx(-0.2)]
    assert call("ngram_repetition", ["every word here is new and unique today"]) == [0.0]
    assert call("ngram_repetition", ["too short"]) == [0.0]
    # a loop of one word, 100 times: 97 4-grams, 1 distinct -> -(1 - 1/97)
    assert call("ngram_repetition", ["la " * 100]) == [pytest.approx(-(1 - 1 / 97))]
    # characters: "abab" bigrams ab, ba, ab -> 1 - 2/3
    assert call("ngram_repetition", ["abab"], n=2, unit="char") == [pytest.approx(-1 / 3)]


def test_length_group_kimi_golden():
    # one group, lengths 10, 20, 30: lambda = 0.5 - (L - 10) / 20 = 0.5, 0.0, -0.5
    cols = dict(completion_length=[10, 20, 30, 5, 5], group_id=[0, 0, 0, 1, 1])
    assert call("length_group", ["a", "b", "c", "d", "e"], reward_short=True, **cols) == [0.5, 0.0, -0.5, 0.0, 0.0]
    assert call("length_group", ["a", "b", "c", "d", "e"], **cols) == [0.0, 0.0, -0.5, 0.0, 0.0]


def test_length_group_with_verifier():
    # correct samples get lambda, wrong ones min(0, lambda): answers 1 (right), 2 (wrong), 1 (right)
    cols = dict(completion_length=[10, 20, 30], group_id=[7, 7, 7], answer=["1", "1", "1"])
    out = call("length_group", ["1", "2", "1"], verifier="exact_match", **cols)
    assert out == [0.5, 0.0, -0.5]
    out = call("length_group", ["2", "1", "2"], verifier="exact_match", **cols)
    assert out == [0.0, 0.0, -0.5]


def test_is_truncated():
    assert is_truncated("length") and not is_truncated("eos") and not is_truncated(None)


# --------------------------------------------------------------------------- demo rewards


def test_exact_and_numeric_match():
    assert call("exact_match", [" 42 \n", "42.0", "x"], answer=["42", "42", None]) == [1.0, 0.0, None]
    out = call("numeric_match", ["so 41 then 42", "1,000", "\u22123", "42.0000001", "none", "7"],
               answer=["42", "1000", -3, 42, "5", "seven"])
    assert out == [1.0, 1.0, 1.0, 1.0, 0.0, None]
    assert call("numeric_match", ["42.1"], answer=["42"], rel_tol=0.01) == [1.0]


# --------------------------------------------------------------------------- every registered reward

STANDARD = dict(answer=["4", "5"], tests=["assert True", "assert True"], steps=[["2"], []], completion_length=[3, 4],
                finish_reason=["eos", "length"], group_id=[0, 0], max_new_tokens=[8, 8],
                some_unknown_column=[{"x": 1}, None])


@pytest.fixture(scope="module")
def judge_models(tmp_path_factory):
    """A tiny (random) classifier and causal LM for the judges, which need a model."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained

    root = tmp_path_factory.mktemp("judges")
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=32, num_labels=1, pad_token_id=tok.pad_token_id)
    return {"reward_model": str(save_pretrained(Qwen2ForSequenceClassification(cfg), tok, root / "rm")),
            "llm_judge": str(save_pretrained(build_tiny_model(tok, hidden=16, layers=1, heads=2, max_positions=512),
                                             tok, root / "lm"))}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_reward_accepts_unknown_columns_and_returns_one_score_each(name, request):
    extra = {"model": request.getfixturevalue("judge_models")[name]} if name in ("reward_model", "llm_judge") else {}
    out = REGISTRY[name](["p", "p"], ["\\boxed{4}", "<think>a</think><answer>5</answer>"], **STANDARD, **extra)
    assert isinstance(out, list) and len(out) == 2
    assert all(v is None or isinstance(v, float) for v in out)


def test_format_checks_are_linear_on_huge_inputs():
    # cheap for the trainer: CPU time of this thread (under 0.1 s per text here; quadratic is minutes)
    from grpokit.rewards import extract_code
    from tests.rewards.clocks import thread_cpu

    for text in ("```python\n" * 20_000, "<think>" * 30_000, "\\boxed{" * 30_000, "```\n" * 50_000 + "x"):
        cpu0 = thread_cpu()
        extract_code(text)
        for name in ("think_answer_format", "boxed_format", "code_format", "ngram_repetition"):
            call(name, [text])
        assert thread_cpu() - cpu0 < 3.0
