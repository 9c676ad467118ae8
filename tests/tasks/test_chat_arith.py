"""The chat arithmetic task: seeded, disjoint splits, and answers that re-computation confirms."""

import re

import pytest

from grpokit.tasks.chat_arith import INSTRUCTION, ChatArithTask


def recompute(question: str) -> int:
    """The answer worked out again from the question text alone."""
    expr = re.fullmatch(r"What is (\d+(?: [-+*] \d+)+)\?", question)
    if expr:
        tokens = expr.group(1).split()
        value = int(tokens[0])
        for op, n in zip(tokens[1::2], map(int, tokens[2::2])):
            value = value + n if op == "+" else value - n if op == "-" else value * n
        return value
    nums = [int(x) for x in re.findall(r"\d+", question)]
    return nums[0] - nums[1] if "gives away" in question else sum(nums)


@pytest.fixture(scope="module")
def task():
    return ChatArithTask(seed=3, train_size=500, heldout_size=64, harder_size=64)


def test_answers_recompute_and_prompts_ask_for_a_box(task):
    for rows in task.splits().values():
        for r in rows:
            assert int(r["answer"]) == recompute(r["question"]) >= 0
            assert r["prompt"] == [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}]


def test_splits_are_disjoint_seeded_and_sized(task):
    q = {name: [r["question"] for r in rows] for name, rows in task.splits().items()}
    assert {k: len(v) for k, v in q.items()} == {"train": 500, "heldout": 64, "harder": 64}
    assert all(len(set(v)) == len(v) for v in q.values())
    assert not set(q["train"]) & set(q["heldout"]) and not set(q["train"]) & set(q["harder"])
    again = ChatArithTask(seed=3, train_size=500, heldout_size=64, harder_size=64)
    assert again.splits() == task.splits()
    assert ChatArithTask(seed=4, train_size=500).heldout != task.heldout


def test_a_validation_split_is_held_out_from_training_and_from_heldout():
    plain = ChatArithTask(seed=3, train_size=500)
    t = ChatArithTask(seed=3, train_size=500, valid_size=64)
    q = {name: [r["question"] for r in rows] for name, rows in t.splits().items()}
    assert len(q["valid"]) == len(set(q["valid"])) == 64 and {r["split"] for r in t.valid} == {"valid"}
    assert not set(q["valid"]) & (set(q["train"]) | set(q["heldout"]) | set(q["harder"]))
    assert t.heldout == plain.heldout and t.harder == plain.harder     # the reported splits stay as they were
    assert "valid" not in plain.splits()
    assert max(int(x) for x in re.findall(r"\d+", " ".join(q["valid"]))) <= t.high


def test_the_validation_split_has_the_held_out_mix_where_training_problems_run_out():
    """Even with a training split that uses up most two-operand problems, the validation split is
    drawn like the held-out one: word problems word_frac, three operands (1 - word_frac) * three_frac."""
    t = ChatArithTask(seed=1, train_size=2000, heldout_size=64, valid_size=600)
    share = {k: sum(kind(r["question"]) == k for r in t.valid) / len(t.valid) for k in ("two", "three", "word")}
    want = {"word": t.word_frac, "three": (1 - t.word_frac) * t.three_frac}
    want["two"] = 1 - want["word"] - want["three"]
    assert all(abs(share[k] - want[k]) < 0.05 for k in want), (share, want)


def kind(question: str) -> str:
    if not question.startswith("What is"):
        return "word"
    return "three" if len(re.findall(r"\d+", question)) == 3 else "two"


def test_with_repeats_training_problems_follow_the_held_out_mix():
    """`train_repeats`: the training split is drawn from the held-out split's distribution (its
    problems may repeat, held-out ones never appear): word problems word_frac, three-operand
    arithmetic (1 - word_frac) * three_frac, two-operand the rest, also where distinct two-operand
    problems run out; a validation split then excludes every training problem."""
    t = ChatArithTask(seed=5, train_size=6000, heldout_size=64, train_repeats=True, valid_size=32)
    share = {k: sum(kind(r["question"]) == k for r in t.train) / len(t.train) for k in ("two", "three", "word")}
    want = {"word": t.word_frac, "three": (1 - t.word_frac) * t.three_frac}
    want["two"] = 1 - want["word"] - want["three"]
    assert all(abs(share[k] - want[k]) < 0.02 for k in want), (share, want)
    assert len({r["question"] for r in t.train}) < len(t.train)          # repeats, as the mix needs
    assert not {r["question"] for r in t.train} & {r["question"] for r in t.heldout + t.valid}


def test_harder_split_has_larger_operands_and_more_of_three(task):
    def operands(rows):
        return [int(x) for r in rows for x in re.findall(r"\d+", r["question"])
                if not re.search(rf"\* {x}\?", r["question"])]     # one-digit factors aside
    assert min(operands(task.harder)) > task.high >= max(operands(task.train + task.heldout))
    three = lambda rows: sum(len(re.findall(r"\d+", r["question"])) == 3 for r in rows) / len(rows)  # noqa: E731
    assert three(task.harder) > three(task.heldout)


def test_impossible_sizes_are_errors():
    with pytest.raises(ValueError, match="cannot draw"):
        ChatArithTask(low=2, high=3, word_frac=0, three_frac=0, train_size=50)
    with pytest.raises(ValueError, match="low <= high"):
        ChatArithTask(low=40, high=30)


def test_write_round_trips(tmp_path, task):
    import json

    paths = task.write(tmp_path)
    for name, rows in task.splits().items():
        assert [json.loads(x) for x in paths[name].read_text().splitlines()] == rows


def test_steps_are_the_first_partial_result_of_three_operand_problems(task):
    """Worked again from the question: the value after the first operator for three operands
    ("What is 24 - 5 + 19?" -> 19; "has 9, buys 9 more and then finds 22 more" -> 18), none otherwise."""
    n_three = 0
    for rows in task.splits().values():
        for r in rows:
            nums = [int(x) for x in re.findall(r"\d+", r["question"])]
            if len(nums) == 3:
                n_three += 1
                ops = re.findall(r" ([-+]) ", r["question"]) or ["+"]
                want = nums[0] + nums[1] if ops[0] == "+" else nums[0] - nums[1]
                assert r["steps"] == [str(want)], r
            else:
                assert r["steps"] == [], r
    assert n_three > 50


def test_the_recipe_finds_its_reward_columns_in_the_task():
    """examples/smollm2.yaml trains on this task: every reward it names, and `step_values` (trials N
    and O of docs/example.md), finds its columns."""
    from pathlib import Path

    from grpokit.config import load_config
    from grpokit.rewards import check_columns

    recipe = Path(__file__).resolve().parents[2] / "examples" / "smollm2.yaml"
    cfg = load_config([str(recipe)], ["model.path=unused", "data.path=unused.jsonl"])
    rows = ChatArithTask(seed=0, train_size=50).train
    check_columns(cfg.rewards, rows, "train")
    check_columns([{"name": "step_values", "args": {}}], rows, "train")
