"""The embedded verifiable task: two-digit addition, with an imperfect teacher.

Prompts look like `47+38=`; the answer is the sum's digits, then EOS. The teacher that writes the
warm-start demonstrations has a systematic misconception: on a problem whose units digits carry, it
forgets the carry (writes 75 for 47+38) except with probability `teacher_correct`. Supervised
training on its demonstrations learns that misconception, and more of it cannot do better than the
teacher: on carrying problems the teacher's most likely answer is wrong. A verifier that only says
right/wrong is enough for GRPO to find and reinforce the carrying answers the model already
samples now and then. Problems are drawn with a units carry with probability `carry_frac`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


def has_carry(a: int, b: int) -> bool:
    return (a % 10) + (b % 10) >= 10


def no_carry_sum(a: int, b: int) -> int:
    """The teacher's mistake: units digit right, the carry into the tens dropped."""
    return (a % 10 + b % 10) % 10 + 10 * (a // 10 + b // 10)


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


@dataclass
class ArithmeticTask:
    seed: int = 0
    low: int = 10
    high: int = 99
    carry_frac: float = 0.8
    teacher_correct: float = 0.25
    heldout: int = 200

    def __post_init__(self):
        rng = random.Random(self.seed)
        pairs = [(a, b) for a in range(self.low, self.high + 1) for b in range(self.low, self.high + 1)]
        rng.shuffle(pairs)
        carry = [p for p in pairs if has_carry(*p)]
        plain = [p for p in pairs if not has_carry(*p)]
        n_carry = round(self.heldout * self.carry_frac)
        self.heldout_pairs = carry[:n_carry] + plain[: self.heldout - n_carry]
        rng.shuffle(self.heldout_pairs)
        self._carry, self._plain = carry[n_carry:], plain[self.heldout - n_carry:]
        self._rng = random.Random(self.seed + 1)

    def draw(self, n: int, rng: random.Random | None = None) -> list[tuple[int, int]]:
        """n training problems (never held-out ones), carrying with probability carry_frac."""
        rng = rng or self._rng
        return [rng.choice(self._carry if rng.random() < self.carry_frac else self._plain) for _ in range(n)]

    def teacher(self, a: int, b: int, rng: random.Random) -> str:
        if has_carry(a, b) and rng.random() >= self.teacher_correct:
            return str(no_carry_sum(a, b))
        return str(a + b)

    def teacher_accuracy(self, n: int = 4000, seed: int = 123) -> float:
        rng = random.Random(seed)
        probs = self.draw(n, random.Random(seed + 1))
        return sum(self.teacher(a, b, rng) == str(a + b) for a, b in probs) / n

    @staticmethod
    def row(a: int, b: int) -> dict:
        return {"prompt": prompt_of(a, b), "answer": str(a + b)}

    def heldout_rows(self) -> list[dict]:
        return [self.row(a, b) for a, b in self.heldout_pairs]

    def train_rows(self, n: int, seed: int) -> list[dict]:
        return [self.row(a, b) for a, b in self.draw(n, random.Random(seed))]
