"""The held-out split carved by default (`data.eval_split`) and the checker that scores it
(`eval.checker: auto`, grpokit.rewards.checker): which checker each kind of run gets, and that a
default run evaluates on its own split without being asked."""

import json
import logging

import pytest

from grpokit import rewards
from grpokit.config import load_config
from grpokit.data.datasets import HELDOUT_MIN, PromptDataset, carve_heldout
from grpokit.rewards.checker import choose_checker
from grpokit.tasks.arithmetic import ArithmeticTask
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


if "test_varied_count" not in rewards.REGISTRY:
    @rewards.register("test_varied_count")
    def _count(prompts, completions, *, answer, **columns):
        """A user's reward: how often the answer occurs in the completion."""
        return [float(str(c).count(str(a))) for c, a in zip(completions, answer)]


def _ds(n, repeats=1):
    return PromptDataset([{"prompt": f"q{i}", "answer": str(i)} for i in range(n) for _ in range(repeats)], "d.jsonl")


# ----------------------------------------------------------------------- carving
def test_a_carved_split_is_seeded_capped_and_shares_no_prompt_with_training():
    ds = _ds(3000, repeats=2)                                      # every prompt twice
    train, held = carve_heldout(ds, 0.05, 100, seed=3)
    assert len({r["prompt"] for r in held.rows}) == len(held) == 100    # 5% of 3000 = 150, capped; each once
    assert len(train) == 6000 - 200                                # a drawn prompt leaves with all its rows
    assert not {r["prompt"] for r in held.rows} & {r["prompt"] for r in train.rows}
    assert carve_heldout(ds, 0.05, 100, seed=3)[1].rows == held.rows          # seeded
    assert carve_heldout(ds, 0.05, 100, seed=4)[1].rows != held.rows
    assert "held-out" in held.source and train.source == "d.jsonl"


def test_a_split_is_at_least_the_minimum_and_small_data_is_not_split():
    train, held = carve_heldout(_ds(400), 0.01, 100, seed=0)       # 1% of 400 = 4: raised to the minimum
    assert len(held) == HELDOUT_MIN and len(train) == 400 - HELDOUT_MIN
    why = carve_heldout(_ds(99), 0.05, 100, seed=0)                # 20 out would leave under 4 x 20
    assert isinstance(why, str) and "99 distinct prompts are too few" in why
    assert isinstance(carve_heldout(_ds(50, repeats=10), 0.05, 100, seed=0), str)   # distinct prompts count


# ----------------------------------------------------------------------- the checker
MATH_ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x", "answer": "\\frac{1}{2}"}] * 10
NUM_ROWS = [{"prompt": f"{n}+1=", "answer": str(n + 1)} for n in range(20)]
TEXT_ROWS = [{"prompt": "capital of France?", "answer": "Paris"}] * 20
CHOICE_ROWS = [{"prompt": "pick one", "answer": c} for c in "ABCD"] * 5


@pytest.mark.parametrize("rewards, rows, name, independent", [
    ([{"name": "math_accuracy"}], MATH_ROWS, "math_accuracy_alt", True),
    ([{"name": "math_accuracy", "args": {"strict_numbers": False}}], MATH_ROWS, "math_accuracy_alt", True),
    ([{"name": "math_accuracy_alt"}], MATH_ROWS, "math_accuracy", True),
    ([{"name": "math_accuracy"}, {"name": "math_accuracy_alt"}], MATH_ROWS, "math_accuracy", False),
    ([{"name": "exact_match"}, {"name": "boxed_format"}], NUM_ROWS, "math_accuracy_alt", True),
    ([{"name": "test_varied_count"}], NUM_ROWS, "math_accuracy_alt", True),     # a user's reward
    # exact_match pays for a bare \frac{1}{2}, which the alt reads as its last number: not the same answers
    ([{"name": "exact_match"}], MATH_ROWS, "exact_match", False),
    ([{"name": "exact_match"}], TEXT_ROWS, "exact_match", False),       # no verifier for text: said so
    ([{"name": "exact_match"}], CHOICE_ROWS, "exact_match", False),     # nor for a letter
    ([{"name": "exact_match", "weight": 0.0}, {"name": "numeric_match"}], MATH_ROWS, "exact_match", True),
    ([{"name": "code_tests"}, {"name": "code_format", "weight": 0.2}], [{"prompt": "p", "tests": ["assert 1"]}],
     "code_tests", True),
])
def test_auto_picks_a_checker_that_shares_no_code_with_the_training_rewards(rewards, rows, name, independent):
    ch = choose_checker("auto", {}, rewards, rows)
    assert (ch.name, ch.independent) == (name, independent)
    if name.startswith("math"):
        assert "strict_numbers" not in ch.args                       # a loosened training reward is not copied
    said = ch.describe()
    assert ("cannot see it" in said) == (not independent)


def test_a_math_checker_reads_the_training_rewards_answer_column():
    ch = choose_checker("auto", {}, [{"name": "math_accuracy", "args": {"answer_column": "solution"}}],
                        [{"prompt": "p", "solution": "3"}] * 4)
    assert ch.name == "math_accuracy_alt" and ch.args == {"answer_column": "solution"}
    assert ch.reward_set().score(["p"], ["\\boxed{3}"], {"solution": ["3"]}).per_fn["math_accuracy_alt"] == [1.0]


def test_a_named_checker_that_is_a_training_reward_is_said_not_independent():
    ch = choose_checker("math_accuracy", {}, [{"name": "math_accuracy", "args": {"timeout_s": 2.0}}], MATH_ROWS)
    assert not ch.independent and ch.args == {"timeout_s": 2.0}
    assert choose_checker("math_accuracy_alt", {}, [{"name": "math_accuracy"}], MATH_ROWS).independent


def test_an_unknown_checker_is_a_config_error():
    with pytest.raises(ValueError, match="math_acuracy"):
        load_config(None, ["eval.checker=math_acuracy"])


# ----------------------------------------------------------------------- a default run
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("heldout"), n_train=2000)


def test_a_default_run_carves_its_split_and_evaluates_it_independently(setup, caplog):
    """No eval file, no checker named: the run says it carved 5% (capped at 100), scores it with
    the independent math checker before the first step, every `train.eval_every` steps and after
    the last, and trains on the rest."""
    root, model_dir, train, _ = setup
    caplog.set_level(logging.INFO, logger="grpokit.train")
    over = small_overrides(model_dir, train, root / "run", **{"train.steps": 3, "train.eval_every": 2})
    cfg = load_config(None, [o for o in over if not o.startswith("data.eval_split=")])
    assert cfg.data.eval_split > 0 and cfg.data.eval_path == ""
    tr = build_trainer(cfg, health=False)
    distinct = len({r["prompt"] for r in ArithmeticTask(seed=0, heldout=32).train_rows(2000, 0)})
    assert len({r["prompt"] for r in tr.eval_dataset.rows}) == min(100, max(20, round(0.05 * distinct)))
    assert not {r["prompt"] for r in tr.eval_dataset.rows} & {r["prompt"] for r in tr.dataset.rows}
    assert "held-out split: " in caplog.text and "held-out pass@1 is scored by math_accuracy_alt" in caplog.text
    assert tr.checker.names == ["math_accuracy_alt"]
    tr.train()
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [0, 2, 3]


def test_data_too_small_to_split_trains_whole_and_says_the_alarm_cannot_fire(setup, caplog, tmp_path):
    root, model_dir, _, _ = setup
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in ArithmeticTask(seed=0).train_rows(60, 1)))
    over = [o for o in small_overrides(model_dir, small, tmp_path / "run") if not o.startswith("data.eval_split=")]
    tr = build_trainer(load_config(None, over), health=False)
    assert tr.eval_dataset is None and len(tr.dataset) == 60
    assert "no held-out split" in caplog.text and "reward-hacking alarm cannot fire" in caplog.text
