"""Calculator episodes: arithmetic a small model cannot do in its head, and a calculator tool.

Problems (seeded, as grpokit.tasks.chat_arith) in five shapes over 2-digit numbers: a product, a
product plus or minus a number, a sum of two products, an equal share. Each is asked either bare
("What is 37 * 48 + 5?") or as a short word problem (boxes of items, a purchase of two kinds, what
is left after a gift, sharing among friends) whose expression the model has to compose from the
sentences. The `harder` split has 3-digit operands. Each row is one user turn asking for the final
answer in `\\boxed{}`, with the integer `answer` and the `expression` that computes it.

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


Problem = tuple[str, int, str]   # question, answer, the expression a calculator call needs


# The five shapes: (the expression, the word problem asking for it); `ab` is a * b.
_SHAPES = [
    ("{a} * {b}", "{who} has {a} boxes of {item} with {b} {item} in each box. How many {item} does {who} have?"),
    ("{a} * {b} + {c}", "{who} has {a} bags with {b} {item} in each bag, and {c} more {item} on the desk. "
                        "How many {item} does {who} have in all?"),
    ("{a} * {b} - {c}", "{who} fills {a} jars with {b} {item} each, then gives away {c} {item}. "
                        "How many {item} are left?"),
    ("{a} * {b} + {c} * {d}", "{who} buys {a} {item} at {b} cents each and {c} {other} at {d} cents each. "
                              "How many cents does {who} spend?"),
    ("{ab} / {b}", "{ab} {item} are shared equally among {b} friends. How many {item} does each friend get?"),
]


def _direct(rng: random.Random, lo: int, hi: int) -> Problem:
    """A bare expression in one of the shapes ("What is 37 * 48 + 5?")."""
    a, b, c, d = (rng.randint(lo, hi) for _ in range(4))
    expr = _SHAPES[rng.randrange(len(_SHAPES))][0].format(a=a, b=b, c=c, d=d, ab=a * b)
    return f"What is {expr}?", int(calculate(expr)), expr


def _word(rng: random.Random, lo: int, hi: int) -> Problem:
    """A short word problem whose calculator expression has to be composed from its sentences."""
    who, item, other = rng.choice(NAMES), *rng.sample(ITEMS, 2)
    a, b, c, d = (rng.randint(lo, hi) for _ in range(4))
    expr_fmt, question = _SHAPES[rng.randrange(len(_SHAPES))]
    v = dict(a=a, b=b, c=c, d=d, ab=a * b, who=who, item=item, other=other)
    expr = expr_fmt.format(**v)
    return question.format(**v), int(calculate(expr)), expr


@dataclass
class CalculatorTask:
    """Seeded, distinct splits `train`, `heldout` and `harder` (3-digit operands), a share
    `word_frac` of each split word problems and the rest bare expressions. Rows carry the
    `expression` a right call needs."""

    seed: int = 0
    train_size: int = 2000
    heldout_size: int = 64
    harder_size: int = 64
    low: int = 12
    high: int = 99
    hard_high: int = 999
    word_frac: float = 0.5

    def __post_init__(self):
        rng = random.Random(self.seed)
        seen: set[str] = set()

        def draw(n: int, split: str, lo: int, hi: int) -> list[dict]:
            rows, tries = [], 0
            while len(rows) < n:
                tries += 1
                if tries > 100 * n + 1000:
                    raise ValueError(f"cannot draw {n} distinct {split} problems")
                q, a, expr = (_word if rng.random() < self.word_frac else _direct)(rng, lo, hi)
                if q in seen:
                    continue
                seen.add(q)
                rows.append({"prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}], "answer": str(a),
                             "question": q, "expression": expr, "split": split})
            return rows

        self.heldout = draw(self.heldout_size, "heldout", self.low, self.high)
        self.harder = draw(self.harder_size, "harder", self.high + 1, self.hard_high)
        self.train = draw(self.train_size, "train", self.low, self.high)

    def splits(self) -> dict[str, list[dict]]:
        return {"train": self.train, "heldout": self.heldout, "harder": self.harder}

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write `<split>.jsonl` files into `out_dir`; returns their paths by split."""
        return write_splits(self.splits(), out_dir)
