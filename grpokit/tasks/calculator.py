"""Calculator episodes: arithmetic a small model cannot do in its head, and a calculator tool.

Problems (seeded, as grpokit.tasks.chat_arith): products of a 2-digit and a 2- or 3-digit number,
three-operand expressions with a product in them, and short word problems over the same numbers.
The `harder` split has larger operands. Each row is one user turn asking for the final answer in
`\\boxed{}`, with the integer `answer`.

`CalculatorEnv` (`rollout.env: grpokit.tasks.calculator:CalculatorEnv`) offers one tool,
`calculator(expression)`, which evaluates +, -, *, / and parentheses over integers and decimals with
Python's `ast` (no names, no calls, bounded sizes): a model that calls it with the right expression
and copies the result into its box gets the answer right.
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from pathlib import Path

from grpokit.tasks.chat_arith import ITEMS, NAMES, write_splits

INSTRUCTION = "Use the calculator, then put the final answer in \\boxed{}."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression safely (numbers, + - * /, parentheses, unary minus)."""
    if len(expression) > 200:
        raise ValueError("the expression is over 200 characters")
    tree = ast.parse(expression.replace("x", "*").replace("\u00d7", "*"), mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Mult) and abs(a) * abs(b) > 1e15:
                raise ValueError("the result is too large")
            return _OPS[type(node.op)](a, b)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        raise ValueError(f"only numbers, + - * / and parentheses are allowed (found {type(node).__name__})")

    value = ev(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


class CalculatorEnv:
    """One calculator tool; no state beyond the calls it answered."""

    def reset(self, **row):
        self.calls = 0
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "37 * 48 + 5"
        """
        self.calls += 1
        return calculate(expression)


Problem = tuple[str, int]


def _product(rng: random.Random, lo: int, hi: int) -> Problem:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi * (10 if rng.random() < 0.4 else 1))
    return f"What is {a} * {b}?", a * b


def _three(rng: random.Random, lo: int, hi: int) -> Problem:
    a, b, c = rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi * 5)
    if rng.random() < 0.5:
        return f"What is {a} * {b} + {c}?", a * b + c
    return f"What is {a} * {b} - {c}?", a * b - c


def _word(rng: random.Random, lo: int, hi: int) -> Problem:
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, each = rng.randint(lo, hi), rng.randint(lo, hi)
    return (f"{who} has {boxes} boxes of {item} with {each} {item} in each box. "
            f"How many {item} does {who} have?", boxes * each)


@dataclass
class CalculatorTask:
    """Seeded, distinct splits: `train`, `heldout` and `harder` (larger operands)."""

    seed: int = 0
    train_size: int = 2000
    heldout_size: int = 64
    harder_size: int = 64
    low: int = 12
    high: int = 99
    hard_high: int = 999
    word_frac: float = 0.2
    three_frac: float = 0.3

    def __post_init__(self):
        rng = random.Random(self.seed)
        seen: set[str] = set()

        def draw(n: int, split: str, lo: int, hi: int) -> list[dict]:
            rows, tries = [], 0
            while len(rows) < n:
                tries += 1
                if tries > 100 * n + 1000:
                    raise ValueError(f"cannot draw {n} distinct {split} problems")
                u = rng.random()
                q, a = (_word(rng, lo, hi) if u < self.word_frac else
                        _three(rng, lo, hi) if u < self.word_frac + self.three_frac else _product(rng, lo, hi))
                if q in seen:
                    continue
                seen.add(q)
                rows.append({"prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}], "answer": str(a),
                             "question": q, "split": split})
            return rows

        self.heldout = draw(self.heldout_size, "heldout", self.low, self.high)
        self.harder = draw(self.harder_size, "harder", self.high + 1, self.hard_high)
        self.train = draw(self.train_size, "train", self.low, self.high)

    def splits(self) -> dict[str, list[dict]]:
        return {"train": self.train, "heldout": self.heldout, "harder": self.harder}

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write `<split>.jsonl` files into `out_dir`; returns their paths by split."""
        return write_splits(self.splits(), out_dir)
