"""The embedded task: held-out problems never drawn for training, the teacher's error rate, seeds."""

import random

import pytest

from grpokit.tasks.arithmetic import ArithmeticTask, has_carry, no_carry_sum


def test_the_teachers_mistake_is_the_dropped_carry():
    assert no_carry_sum(47, 38) == 75 and 47 + 38 == 85
    assert no_carry_sum(12, 34) == 46 == 12 + 34            # no carry: the teacher is right
    assert has_carry(47, 38) and not has_carry(12, 34)


def test_held_out_problems_are_never_drawn_for_training():
    task = ArithmeticTask(seed=3, heldout=300)
    held = set(task.heldout_pairs)
    assert len(held) == 300
    drawn = task.draw(20000, random.Random(0))
    assert not held & set(drawn)
    assert all(task.low <= a <= task.high and task.low <= b <= task.high for a, b in drawn)


@pytest.mark.parametrize("carry_frac,teacher_correct", [(0.8, 0.25), (0.5, 0.0), (0.2, 1.0)])
def test_carry_share_and_teacher_accuracy_follow_the_settings(carry_frac, teacher_correct):
    task = ArithmeticTask(seed=1, carry_frac=carry_frac, teacher_correct=teacher_correct)
    drawn = task.draw(8000, random.Random(5))
    assert abs(sum(has_carry(a, b) for a, b in drawn) / len(drawn) - carry_frac) < 0.02
    expected = (1 - carry_frac) + carry_frac * teacher_correct      # right on every non-carry problem
    assert abs(task.teacher_accuracy(n=8000) - expected) < 0.02
    held_carry = sum(has_carry(a, b) for a, b in task.heldout_pairs)
    assert held_carry == round(task.heldout * carry_frac)


def test_rows_hold_the_true_sum_and_seeds_reproduce():
    a, b = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
    assert a.heldout_rows() == b.heldout_rows() and a.train_rows(50, 1) == b.train_rows(50, 1)
    assert ArithmeticTask(seed=8).heldout_rows() != a.heldout_rows()
    for row in a.train_rows(200, 2):
        x, y = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == str(int(x) + int(y))
