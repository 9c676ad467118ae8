"""Verifiable rewards: plain functions registered by name, composed with weights from config.

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

Importing this package registers the built-ins (cheap: no process starts until a reward runs):

| name                  | module     | what it pays                                                  |
|-----------------------|------------|---------------------------------------------------------------|
| exact_match           | basic      | completion == answer (stripped)                                |
| numeric_match         | basic      | last number == answer (relative tolerance)                     |
| math_accuracy         | math       | final answer equivalent to the reference (math-verify)         |
| math_accuracy_alt     | math       | independent checker for CrossCheck (own extraction, sympy)     |
| code_tests            | code       | fraction of unit tests passed in the sandbox                   |
| think_answer_format   | format     | one real <think> then one real <answer>                        |
| boxed_format          | format     | exactly one real \\boxed{}                                      |
| code_format           | format     | a fenced python block that parses and does something           |
| soft_overlong         | penalties  | DAPO soft overlong punishment (<= 0)                           |
| ngram_repetition      | penalties  | minus the repeated n-gram fraction (<= 0)                      |
| length_group          | penalties  | Kimi k1.5 length penalty within the group                      |
| format_violation      | penalties  | -penalty when the format is broken                             |
| reward_model          | judges     | a local sequence-classification model's score                  |
| llm_judge             | judges     | a local causal LM's rubric score, parsed, in [0, 1]            |

`check_determinism` / `check_rows` (determinism.py) warn about rewards that score the same
completion differently from one call to the next.

A `rewards:` entry may also name a user's function by import reference (`my_rewards:score`, TRL's
`my_rewards.score`, or `path/to/file.py:score`); `user.py` imports and checks it, and lists the
dataset columns each reward needs (`required_columns`, `check_columns`).

See docs/rewards.md for formulas, known holes and the sandbox threat model.
"""

from . import basic, code, format, judges, math, penalties  # noqa: F401 - registers the built-ins
from .code import CodeResult, extract_code, run_tests, run_tests_batch
from .compose import CrossCheck, RewardOutput, RewardSet, RewardSpec, check_args
from .determinism import check_determinism, check_rows, probe_batch
from .math import verify
from .penalties import is_truncated
from .registry import REGISTRY, RewardFn, diagnoses, get, read_column, register
from .user import check_columns, required_columns, resolve

__all__ = [
    "REGISTRY", "RewardFn", "register", "diagnoses", "get", "read_column", "resolve", "required_columns", "check_columns",
    "RewardSpec", "RewardSet", "RewardOutput", "CrossCheck", "check_args",
    "check_determinism", "check_rows", "probe_batch",
    "verify", "run_tests", "run_tests_batch", "CodeResult", "extract_code", "is_truncated",
]
