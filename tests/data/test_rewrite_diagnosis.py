"""Wrong-answer rewriting says why the attempt failed, from the verifier's own diagnosis: the value
given against the expected one (math), the failing test and its error (code)."""

import pytest

from grpokit.config import load_config
from grpokit.data.rewrite import FALLBACK_WHY, note_text, rewrite_sequences
from grpokit.rewards import REGISTRY, register
from grpokit.rewards.code import code_tests
from grpokit.rewards.compose import RewardSet
from grpokit.rewards.math import diagnosis, math_accuracy, math_accuracy_alt
from grpokit.tasks.tiny import build_char_tokenizer
from grpokit.train import build_trainer
from grpokit.train.transforms import StepContext, build_transforms
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir


def test_math_diagnosis_names_the_value_given_and_the_expected_one():
    got = math_accuracy.diagnose(["q"] * 5, [
        "26 + 20 = 45", "\\boxed{21 + 14}", "I cannot tell.", "\\boxed{3} or \\boxed{4}", "The answer is 7.5"],
        answer=["46", "35", "12", "3", "#### 8"])
    assert got == [
        "its final answer is 45, not 46",
        "its final answer 21 + 14 is an expression, not the number 35",
        "it states no final answer; the expected answer is 12",
        "it gives more than one answer (3, 4) where one, 3, is expected",
        "its final answer is 7.5, not 8",
    ]
    assert math_accuracy_alt.diagnose(["q"], ["= 45"], answer=["46"]) == ["its final answer is 45, not 46"]
    assert math_accuracy.diagnose(["q"], ["45"], answer=[None]) == [None]          # no reference: no diagnosis
    assert math_accuracy.diagnose(["q"], ["46"], answer=["46"]) == [None]          # judged wrong otherwise (a time-out)
    # plain equivalence (strict_numbers off) does not call an expression wrong for being one
    assert math_accuracy.diagnose(["q"], ["\\boxed{2 + 3}"], answer=["6"], strict_numbers=False) == [
        "its final answer is 2 + 3, not 6"]


def test_code_diagnosis_names_the_failing_test_and_its_error():
    prog = "```python\ndef add(a, b):\n    return {}\n```"
    got = code_tests.diagnose(["q"] * 5, [
        prog.format("a - b"), prog.format("a / 0"), prog.format("a +"), "no code here",
        "```python\nprint(int(input()) * 2)\n```"],
        tests=["assert add(0, 0) == 0\nassert add(2, 3) == 5", "assert add(2, 3) == 5", "assert add(2, 3) == 5",
               "assert add(2, 3) == 5", [{"input": "2", "output": "3"}]])
    assert got[0] == "the test assert add(2, 3) == 5 fails (assertion is false); 1 of 2 tests pass"
    assert got[1] == "the test assert add(2, 3) == 5 fails (raised ZeroDivisionError); 0 of 1 tests pass"
    assert got[2].startswith("the program fails before its tests: program does not compile: SyntaxError")
    assert got[3] == "it has no fenced code block to run"
    assert got[4] == "the test with input '2' (expected output '3') fails (wrong output); 0 of 1 tests pass"


def test_the_note_combines_diagnosis_and_answer():
    t, a = "\nThat is wrong: {why}.", " The answer is {answer}."
    assert note_text(t, a, why="its final answer is 45, not 46.", answer="46") == \
        "\nThat is wrong: its final answer is 45, not 46. The answer is 46."
    assert note_text(t, a, why=None, answer="46") == f"\nThat is wrong: {FALLBACK_WHY}. The answer is 46."
    assert note_text(t, a, why="the test f(1) == 2 fails", answer=None) == "\nThat is wrong: the test f(1) == 2 fails."
    assert note_text(t, a, why=None, answer=None) is None                   # nothing to teach
    assert note_text(" no: {answer}", a, why="x", answer=None) is None      # the template needs an answer
    assert note_text(" no: {answer}", a, why="x", answer="3") == " no: 3"   # no second answer sentence


def test_rewrite_sequences_skip_right_and_unwritable_samples():
    tok = build_char_tokenizer()
    p = [tok("12+35=")["input_ids"]] * 3
    comps = [tok("57", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
             tok("47", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
             tok("11", add_special_tokens=False)["input_ids"]]
    ctx, tgt = rewrite_sequences(tok, p, comps, ["47", "47", None], [True, False, True],
                                 why=["its final answer is 57, not 47", None, None])
    assert len(ctx) == 1                         # the right answer, and a wrong one with nothing to say, skipped
    assert tok.decode(ctx[0]) == "12+35=57"                          # EOS of the wrong completion removed
    assert tgt[0][-1] == tok.eos_token_id
    assert tok.decode(tgt[0], skip_special_tokens=True) == \
        "\nThat is wrong: its final answer is 57, not 47. The answer is 47."


def test_a_diagnosis_that_raises_is_contained(caplog):
    if "test_diagnosis_raises" not in REGISTRY:
        @register("test_diagnosis_raises")
        def _r(prompts, completions, **columns):
            return [0.0] * len(completions)

        def _broken(prompts, completions, **columns):
            raise RuntimeError("diagnosis down")
        _r.diagnose = _broken
    rs = RewardSet.from_specs([{"name": "test_diagnosis_raises"}])
    assert rs.diagnose(["q", "q"], ["a", "b"], {}) == [None, None]
    assert "diagnosis of reward 'test_diagnosis_raises' failed" in caplog.text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewrite_diag")
    return root, tiny_model_dir(root / "model"), arithmetic_files(root / "data")[0]


def test_the_trainers_rewrite_states_the_value_given(setup):
    """A run with math_accuracy: each note decodes to the value the completion gave and the expected
    one, read independently here from the completion and the row."""
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "run", **{
        "algorithm.rewrite.enabled": True, "rewards": "[{name: math_accuracy}]", "rollout.max_new_tokens": 3}))
    tr = build_trainer(cfg, health=False)
    collector = tr.step_fn.collector
    batch, _ = collector.collect(0)
    (rewrite,) = [t for t in build_transforms(cfg, tokenizer=tr.tokenizer, curriculum=None,
                                              diagnose=collector.diagnose) if t.name == "wrong_answer_rewrite"]
    ctx = StepContext(step=0)
    batch = rewrite(batch, ctx)
    contexts, targets = batch.rewrites
    assert contexts and ctx.metrics["rewrite/sequences"] == len(contexts)
    wrong = [i for i, v in enumerate(batch.scores["math_accuracy"]) if v == 0.0][:len(contexts)]
    assert len(wrong) == len(contexts)
    for i, c, t in zip(wrong, contexts, targets):
        answer = batch.rows[i]["answer"]
        assert c == list(batch.prompt_ids[i]) + batch.completion_ids[i][batch.mask[i].bool()].tolist()[:len(c) - len(batch.prompt_ids[i])]
        note = note_text(cfg.algorithm.rewrite.template, cfg.algorithm.rewrite.answer_template,
                         why=diagnosis(batch.completions[i], answer), answer=answer)
        assert "not " + str(answer) in note or "the expected answer is " + str(answer) in note
        # the tiny model's tokenizer knows arithmetic characters only: compare token ids
        assert t == tr.tokenizer(note, add_special_tokens=False)["input_ids"] + [tr.tokenizer.eos_token_id]


def test_templates_are_checked_at_load():
    with pytest.raises(Exception, match=r"unknown placeholder \{reason\}.*\{answer\}, \{why\}"):
        load_config(None, ["algorithm.rewrite.template=no: {reason}"])
    with pytest.raises(Exception, match=r"answer_template: unknown placeholder \{why\}"):
        load_config(None, ["algorithm.rewrite.answer_template= it is {why}"])
    load_config(None, ["algorithm.rewrite.template=no: {why} ({answer})"])
