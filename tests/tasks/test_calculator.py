"""The calculator task: its tool evaluates arithmetic and nothing else, and its splits are distinct
problems whose answers are right."""

from __future__ import annotations

import re

import pytest

from grpokit.tasks.calculator import CalculatorEnv, CalculatorTask, calculate


@pytest.mark.parametrize("expr, value", [("37 * 48 + 5", "1781"), ("(12 + 3) * 4", "60"), ("7 / 2", "3.5"),
                                         ("-3 * -3", "9"), ("12 x 3", "36"), ("1/3", "0.333333")])
def test_the_calculator_evaluates_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "open('x')", "a + 1", "2 ** 8", "[1, 2]", "9" * 8 + " * " + "9" * 9,
                                  "1 +", "x" * 201])
def test_the_calculator_refuses_anything_else(expr):
    with pytest.raises((ValueError, SyntaxError)):
        calculate(expr)


def test_the_splits_are_distinct_and_their_answers_right():
    task = CalculatorTask(seed=3, train_size=300, heldout_size=40, harder_size=40)
    questions = [r["question"] for rows in task.splits().values() for r in rows]
    assert len(questions) == len(set(questions)) == 380
    words = 0
    for rows in task.splits().values():
        for r in rows:
            # the answer is what the row's expression computes, recomputed here without the tool
            assert int(eval(r["expression"], {"__builtins__": {}})) == int(r["answer"]), r["question"]  # noqa: S307
            assert calculate(r["expression"]) == r["answer"]
            nums = re.findall(r"\d+", r["expression"])
            assert all(n in r["question"] for n in nums)
            bare = r["question"] == f"What is {r['expression']}?"
            words += not bare
            if not bare:                       # a word problem: the expression is not in the text
                assert r["expression"] not in r["question"] and "What is" not in r["question"]
    assert 0.35 < words / 380 < 0.65
    assert max(int(x) for r in task.harder for x in re.findall(r"\d+", r["expression"])) > 99
    env = CalculatorEnv()
    assert env.reset(**task.heldout[0]) is None and env.calculator("2*3") == "6" and env.calls == 1
