"""Trusted side of the code sandbox, part 3: the verdicts.

Each assert-style test's predicate from the plan (`_testplan.py`) is evaluated in the trainer on
the values the sandbox returned (`_values.py`); each stdin/stdout case's captured output is
compared with the expected output, which never left the trainer. A test that needs a value that
is not plain data (the program's own class, a dict view) gets the verdict None: only the sandbox
can judge it, in a second run of its own asserts (`judge_redo`; untrusted).
"""

from __future__ import annotations

import logging

from . import _sandbox_launcher as _launcher
from ._testplan import TestPlan, _Check
from ._values import _LeafError, _NotPlain, _teval, decode_value

logger = logging.getLogger("grpokit.rewards")

# ------------------------------------------------------------------ judging


def _judge_assert(check: _Check, reply: dict | None) -> tuple[bool | None, str]:
    """(passed, why not) for one assert-style test, from the sandbox's reply for it; passed is
    None when a value the predicate needs is not plain data and the sandbox can run the test."""
    if reply is None:
        return False, "not reached"
    if check.pred is None:
        return reply.get("ok") is True, "failed in the sandbox"
    values = reply.get("v")
    if type(values) is not list or len(values) != check.leaves:
        return False, "malformed reply"
    cache: dict[int, object] = {}

    def leaf(k: int):
        if k not in cache:
            cache[k] = decode_value(values[k])
        return cache[k]

    try:
        return bool(_teval(check.pred, leaf)), "assertion is false"
    except _NotPlain as e:
        return (None if check.redo is not None else False), str(e)
    except _LeafError as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001 - TypeError for mixed types, ValueError for refused values, ...
        return False, f"{type(e).__name__}: {e}"[:200]


def _judge_io(want: str, reply: dict | None) -> tuple[bool, str]:
    if reply is None:
        return False, "not reached"
    out, rc = reply.get("out"), reply.get("rc")
    if type(out) is not str or reply.get("over") is not False:
        return False, "output over the limit"
    if type(rc) is not int or rc != 0:
        return False, "ran out of memory" if rc == _launcher.EXIT_MEMORY else f"exit code {rc}"
    return _same_output(out, want), "wrong output"


def _same_output(got: str, want: str) -> bool:
    """Token by token, whitespace-insensitive; numbers within a relative 1e-6."""
    a, b = got.split(), want.split()
    if a == b:
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if abs(fx - fy) > 1e-6 * max(1.0, abs(fy)):
            return False
    return True


def judge(plan: TestPlan, replies: dict[int, dict]) -> list[tuple[bool | None, str]]:
    """(passed, why not) per test; `replies` maps test index to the sandbox's first reply.
    passed is None for a test only the sandbox can judge (see `judge_redo`)."""
    if plan.mode == "io":
        return [_judge_io(want, replies.get(i)) for i, want in enumerate(plan.checks)]
    return [_judge_assert(c, replies.get(i)) for i, c in enumerate(plan.checks)]


def judge_redo(reply: dict | None, why: str) -> tuple[bool, str]:
    """The sandbox's own verdict for a test rerun as its asserts (`TestPlan.redo_steps`):
    forgeable, so the caller counts it as untrusted. `why`: the reason it was rerun."""
    if reply is None:
        return False, f"not reached in the second run ({why})"
    return reply.get("ok") is True, f"failed in the sandbox ({why})"


_untrusted_warned: list[bool] = []


def _warn_untrusted(plan: TestPlan) -> None:
    if _untrusted_warned:
        return
    _untrusted_warned.append(True)
    first = next(c.src for c in plan.checks if isinstance(c, _Check) and not c.trusted)
    logger.warning(
        "grpokit code sandbox: %d of %d tests in a test set cannot be judged outside the sandbox "
        "(e.g. `%s`): their pass/fail comes from the sandboxed process, where a hostile program can "
        "forge it. CodeResult.untrusted counts them; code_tests(trusted_only=True) leaves them out. "
        "Only `assert <expr> <op> <constant>` forms (and test functions made of them) are judged by "
        "the trainer. Logged once; see docs/rewards.md.", plan.untrusted, plan.total, first)
