"""Verifiable chat problems with exact integer answers, for a real instruction-tuned model.

Each row is one user turn asking for the final answer in `\\boxed{}` (the tokenizer's chat template,
with its default system prompt, is applied by the trainer), the integer `answer` and `steps`, the
intermediate results of a three-operand problem (its first partial sum; empty otherwise; what the
`step_values` reward reads). Problems are two- or three-operand arithmetic (`+`, `-`; the harder
split also `*` by a one-digit factor) and short word problems.

The splits, drawn from one seeded generator:
- `train`: what GRPO samples from, never a held-out problem. Its problems are distinct, and as
  there are only ~1,300 distinct two-operand ones (with the defaults), a large split's mix leans to
  three operands and words (about 21% and 30% of 2,000 problems, against 14% and 20% held out);
  with `train_repeats` problems may repeat and the mix is the held-out one;
- `heldout`: distinct problems from the same generator, never trained on (no question in both);
- `valid` (only with `valid_size` > 0): like `heldout` (drawn before the training split, so with
  the held-out mix) and distinct from every other split: a split to choose a policy by
  (`train.keep_best`), so that `heldout` stays unseen by every choice. `heldout` and `harder` are
  the same with or without it; the training split then differs (it excludes the validation
  problems);
- `harder`: larger operands (from `high + 1` to `hard_high`), half of them with three operands, and
  products by a one-digit factor: what generalises beyond the training distribution.
Answers are never negative (a subtraction's operands are ordered), so a missing minus sign cannot
pass for a right answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = "Put the final answer in \\boxed{}."
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kai", "Lena"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]


Problem = tuple[str, int, list[int]]   # question, answer, intermediate results (the `steps` column)


def _arith2(rng: random.Random, lo: int, hi: int, ops: str) -> Problem:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = rng.choice(ops)
    if op == "*":
        b = rng.randint(2, 9)
        return f"What is {a} * {b}?", a * b, []
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", a - b, []
    return f"What is {a} + {b}?", a + b, []


def _arith3(rng: random.Random, lo: int, hi: int) -> Problem:
    a, b, c = (rng.randint(lo, hi) for _ in range(3))
    op1, op2 = rng.choice("+-"), rng.choice("+-")
    first = a + b if op1 == "+" else a - b
    value = first + c if op2 == "+" else first - c
    if value < 0:                       # keep answers non-negative: flip to all-plus
        op1 = op2 = "+"
        first, value = a + b, a + b + c
    return f"What is {a} {op1} {b} {op2} {c}?", value, [first]


def _word(rng: random.Random, lo: int, hi: int, three: bool) -> Problem:
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if three:
        c = rng.randint(lo, hi)
        return (f"{who} has {a} {item}, buys {b} more and then finds {c} more. "
                f"How many {item} does {who} have now?", a + b + c, [a + b])
    if rng.random() < 0.5:
        return f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?", a + b, []
    a, b = max(a, b), min(a, b)
    return f"{who} has {a} {item} and gives away {b}. How many {item} does {who} have left?", a - b, []


def _problem(rng: random.Random, lo: int, hi: int, three_frac: float, word_frac: float, ops: str) -> Problem:
    three = rng.random() < three_frac
    if rng.random() < word_frac:
        return _word(rng, lo, hi, three)
    return _arith3(rng, lo, hi) if three else _arith2(rng, lo, hi, ops)


def row(question: str, answer: int, split: str, steps: list[int] | None = None) -> dict:
    return {"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "answer": str(answer), "steps": [str(v) for v in steps or []], "question": question, "split": split}


@dataclass
class ChatArithTask:
    """Seeded splits of chat arithmetic problems (see the module docstring)."""

    seed: int = 0
    train_size: int = 2000
    heldout_size: int = 64
    harder_size: int = 64
    valid_size: int = 0           # 0: no validation split
    train_repeats: bool = False   # training problems may repeat (its mix is then the held-out one)
    low: int = 2
    high: int = 30
    hard_high: int = 99
    three_frac: float = 0.15      # share of three-operand problems in train / heldout (harder: 0.5)
    word_frac: float = 0.2        # share of word problems

    def __post_init__(self):
        if not (1 <= self.low <= self.high < self.hard_high):
            raise ValueError(f"need 1 <= low <= high < hard_high, got {self.low}, {self.high}, {self.hard_high}")
        rng = random.Random(self.seed)
        seen: set[str] = set()

        def draw(n: int, split: str, lo: int, hi: int, three: float, ops: str, distinct: bool = True) -> list[dict]:
            rows, tries = [], 0
            while len(rows) < n:
                tries += 1
                if tries > 100 * n + 1000:
                    raise ValueError(f"cannot draw {n} distinct {split} problems from operands {lo}..{hi}")
                q, a, steps = _problem(rng, lo, hi, three, self.word_frac, ops)
                if q not in seen:
                    if distinct:
                        seen.add(q)
                    rows.append(row(q, a, split, steps))
            return rows

        # held-out splits first, so the training split is whatever remains distinct from them. The
        # validation split comes before the training one: drawn after it, from the problems that
        # are left, its mix would lean to words and three operands as the training split's does
        self.heldout = draw(self.heldout_size, "heldout", self.low, self.high, self.three_frac, "+-")
        self.harder = draw(self.harder_size, "harder", self.high + 1, self.hard_high, 0.5, "+-*")
        self.valid = draw(self.valid_size, "valid", self.low, self.high, self.three_frac, "+-")
        self.train = draw(self.train_size, "train", self.low, self.high, self.three_frac, "+-",
                          distinct=not self.train_repeats)

    def splits(self) -> dict[str, list[dict]]:
        out = {"train": self.train, "heldout": self.heldout, "harder": self.harder}
        return {**out, "valid": self.valid} if self.valid_size else out

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write `<split>.jsonl` files into `out_dir`; returns their paths by split."""
        return write_splits(self.splits(), out_dir)


def write_splits(splits: dict[str, list[dict]], out_dir: str | Path) -> dict[str, Path]:
    """`<split>.jsonl` for each named list of rows, in `out_dir`; their paths by split."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in splits.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
