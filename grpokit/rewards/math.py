"""Math correctness: is the final answer of a completion equivalent to the reference?

    math_accuracy = 1.0 if verify(completion, answer) else 0.0     (None: no reference / checker down)

Extraction (`_mathcore.extract_answer`): the boxed answers (`\\boxed{}`/`\\fbox{}`, nested braces),
else the last explicit "answer is ..." / "Answer: ..." / "#### ...", else the last number of the
final line. A hedge is wrong: several different boxed answers, a box and a later statement that
disagree, or a candidate list ("3 or 4", "$3$, $4$") in the final statement, unless the reference
itself is a collection (then "or" reads as a list). An ordered answer (tuple, point, interval)
never equals a set.

Equivalence is math-verify's (sympy underneath) after a light normalisation it lacks (unicode
symbols, LaTeX thousands separators, "degrees"); an identical answer never leaves this process.
A reference that is one number needs an answer written as one number (`strict_numbers`, on by
default): math-verify evaluates `21 + 14` to 35, so a policy that copies the question into the box
("What is 21 + 14?" -> `\\boxed{21 + 14}`) would otherwise collect the full reward; a GRPO run on
a chat model found exactly that (docs/rewards.md, "A number needs a number"). `strict_numbers=False` restores plain equivalence.
Every other comparison runs in a checker process with a hard time limit (default 1.5 s for the
whole completion: a timer inside the checker stops most overruns at 70% of it, the parent kills
the process at 100%), so `10^{10^{10^{10}}}` returns False within 2 s; a timeout scores 0, never
None, so a model cannot escape a bad score by producing pathological answers. Both rewards are
registered with `own_time_limit=True`, so by default the composer puts no budget over the whole
batch (which, exceeded by many slow answers, would score every sample None).

`math_accuracy_alt` is the independent cross-checker (own extraction, sympy-only equivalence,
`_mathalt.py`), meant for `CrossCheck`, not for training on.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from . import _mathalt as alt
from . import _mathcore as core
from ._mathcore import Extraction, extract_answer  # noqa: F401 - public helpers
from ._workers import WorkerError, WorkerPool
from .registry import diagnoses, read_column, register

DEFAULT_TIMEOUT_S = 1.5  # the limit is 2 s; the rest is margin for the kill and a slow machine

_pool: list[WorkerPool] = []
_pool_lock = threading.Lock()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _workers() -> WorkerPool:
    with _pool_lock:
        if not _pool:
            _pool.append(WorkerPool(os.path.abspath(core.__file__), size=min(4, _cores())))
        return _pool[0]


def _check(op: str, pred: str, ref: str, deadline: float) -> bool | None:
    """Equivalence in a worker. False on timeout; None if no worker could answer."""
    left = deadline - time.monotonic()
    if left <= 0.05:
        return False
    try:
        rep = _workers().call({"op": op, "pred": pred, "ref": ref, "budget": left * 0.7}, left)
    except WorkerError:
        return None
    return False if rep is None else bool(rep.get("ok"))


_TEXT_WORD = re.compile(r"\\(?:text|mathrm|textbf)\s*\{\s*(or|and|and/or)\s*\}")
_DISJ = re.compile(r"\bor\b|\\lor\b|\\vee\b|\beither\b")


def _is_collection(ref: str) -> bool:
    s = core.squash(ref)
    return bool(re.search(r",(?!\d{3}(?!\d))", s) or "\\pm" in s or "\\cup" in s or _DISJ.search(ref))


def _bracket_kind(ans: str) -> str | None:
    """What brackets the whole answer: "set" for `\\{...\\}`; "ordered" for `(...)` / `[...]` with a
    top-level comma (a tuple, a point, an interval); else None (a bare list `1, 2` is left to
    math-verify, which reads it as a set)."""
    s = core.squash(ans)
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, inner = "set", s[2:-2]
    elif s[:1] in "([" and s[-1:] in ")]":
        kind, inner = "ordered", s[1:-1]
    else:
        return None
    depth, top_comma = 0, False
    for ch in inner:  # the outer brackets must hold the whole answer: not "(0,1)\\cup(2,3)"
        depth += (ch in "([{") - (ch in ")]}")
        if depth < 0:
            return None
        top_comma = top_comma or (ch == "," and depth == 0)
    return kind if kind == "set" or top_comma else None


def _set_vs_ordered(ans: str, ref: str) -> bool:
    """math-verify lets a tuple equal a set (`(2,1)` = `\\{1,2\\}`, it sorts both); an ordered
    answer never equals a set here, whichever side is which."""
    return {_bracket_kind(ans), _bracket_kind(ref)} == {"set", "ordered"}


def judge(completion: str, reference, *, timeout_s: float = DEFAULT_TIMEOUT_S,
          strict_numbers: bool = True) -> bool | None:
    """True / False; None when the sample cannot be scored (no reference, checker unavailable).
    Never raises; returns within about `timeout_s`. `strict_numbers`: a reference that is one
    number needs an answer written as one number (`_mathcore.unevaluated`)."""
    deadline = time.monotonic() + timeout_s
    try:
        if reference is None:
            return None
        ref = core.normalize(core.reference_answer(reference))
        if not ref or len(ref) > core.MAX_ANSWER_CHARS:
            return None
        ex = extract_answer(completion if isinstance(completion, str) else str(completion))
        answers = [core.normalize(a) for a in ex.answers]
        answers = [a for a in answers if a]
        if not answers or any(len(a) > core.MAX_ANSWER_CHARS for a in answers):
            return False
        distinct = list({core.squash(a): a for a in answers}.values())
        if len(distinct) > core.MAX_BOXED:
            return False
        for ans in distinct:  # several boxed answers: each must be right (then they agree)
            ans = _TEXT_WORD.sub(r" \1 ", ans)
            if ex.hedged or _DISJ.search(ans):
                if not _is_collection(ref) or ex.source == "last_number":
                    return False
                ans = _DISJ.sub(",", ans)
            if core.squash(ans) == core.squash(ref):
                continue
            if strict_numbers and core.unevaluated(ans, ref):
                return False
            if _set_vs_ordered(ans, ref):
                return False
            ok = _check("verify", ans, ref, deadline)
            if not ok:
                return ok
        return True
    except Exception:  # noqa: BLE001 - the contract is "never raises"; an unreadable input is wrong
        return False


def verify(completion: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
           strict_numbers: bool = True) -> bool:
    """Is the final answer of `completion` equivalent to `reference`? Never raises; hard time
    limit `timeout_s` (False when exceeded)."""
    return judge(completion, reference, timeout_s=timeout_s, strict_numbers=strict_numbers) is True


def judge_alt(completion: str, reference, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              strict_numbers: bool = True) -> bool | None:
    """The independent path: last box / answer line / last number, then sympy-only equivalence
    (and its own reading of `strict_numbers`: `_mathalt.unevaluated_alt`)."""
    deadline = time.monotonic() + timeout_s
    try:
        if reference is None:
            return None
        ref = alt.reference_alt(reference)
        if not ref:
            return None
        pred = alt.extract_alt(completion if isinstance(completion, str) else str(completion))
        if not pred or len(pred) > core.MAX_ANSWER_CHARS or len(ref) > core.MAX_ANSWER_CHARS:
            return False
        if pred.replace(" ", "") == ref.replace(" ", ""):
            return True
        if strict_numbers and alt.unevaluated_alt(pred, ref):
            return False
        return _check("alt", pred, ref, deadline)
    except Exception:  # noqa: BLE001
        return False


def _batch(fn, completions, refs, timeout_s, strict_numbers) -> list[float | None]:
    items = list(zip(completions, refs))
    work = lambda cr: fn(cr[0], cr[1], timeout_s=timeout_s, strict_numbers=strict_numbers)  # noqa: E731
    if len(items) <= 1:
        res = [work(it) for it in items]
    else:
        with ThreadPoolExecutor(max_workers=min(len(items), _workers().size)) as ex:
            res = list(ex.map(work, items))
    return [None if r is None else float(r) for r in res]


@register("math_accuracy", own_time_limit=True, columns=["{answer_column}"])
def math_accuracy(prompts, completions, *, answer_column: str = "answer",
                  timeout_s: float = DEFAULT_TIMEOUT_S, strict_numbers: bool = True,
                  **columns) -> list[float | None]:
    """1.0 if the completion's final answer is equivalent to the reference, else 0.0.
    `strict_numbers` (default): when the reference is one number, so must the answer be, not an
    expression that evaluates to it (`\\boxed{21 + 14}` for "What is 21 + 14?" scores 0)."""
    refs = read_column("math_accuracy", answer_column, columns, len(completions))
    return _batch(judge, completions, refs, timeout_s, strict_numbers)


@register("math_accuracy_alt", own_time_limit=True, columns=["{answer_column}"])
def math_accuracy_alt(prompts, completions, *, answer_column: str = "answer",
                      timeout_s: float = DEFAULT_TIMEOUT_S, strict_numbers: bool = True,
                      **columns) -> list[float | None]:
    """Independent second checker for `CrossCheck` (see the module docstring)."""
    refs = read_column("math_accuracy_alt", answer_column, columns, len(completions))
    return _batch(judge_alt, completions, refs, timeout_s, strict_numbers)


def diagnosis(completion: str, reference, *, strict_numbers: bool = True) -> str | None:
    """Why `completion` is wrong against `reference`, in words (the answer given against the
    expected one), for wrong-answer rewriting; None without a reference. It reads the answer as
    `judge` does but runs no equivalence check: call it on completions already judged wrong."""
    if reference is None:
        return None
    try:
        ref = core.reference_answer(reference)
        if not ref:
            return None
        ex = extract_answer(completion if isinstance(completion, str) else str(completion))
        given = list({core.squash(a): a for a in (x.strip() for x in ex.answers) if a}.values())
        if not given:
            return f"it states no final answer; the expected answer is {ref}"
        if len(given) > 1 or ex.hedged:
            return f"it gives more than one answer ({', '.join(_short(g) for g in given[:4])}) where one, {ref}, is expected"
        ans = given[0]
        if core.squash(core.normalize(ans)) == core.squash(core.normalize(ref)):
            return None              # judged wrong for another reason (a time-out): nothing true to say
        if strict_numbers and core.unevaluated(core.normalize(ans), core.normalize(ref)):
            return f"its final answer {_short(ans)} is an expression, not the number {ref}"
        return f"its final answer is {_short(ans)}, not {ref}"
    except Exception:  # noqa: BLE001 - a diagnosis is optional; an unreadable input has none
        return None


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


@diagnoses(math_accuracy)
@diagnoses(math_accuracy_alt)
def _math_diagnosis(prompts, completions, *, answer_column: str = "answer", strict_numbers: bool = True,
                    **columns) -> list[str | None]:
    refs = read_column("math_accuracy", answer_column, columns, len(completions))
    return [diagnosis(c, r, strict_numbers=strict_numbers) for c, r in zip(completions, refs)]


_RATIO = re.compile(r"([+-]?)(?:\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}|\\frac(\d)(\d)|(\d+)/([+-]?\d+))")
_SCI = re.compile(r"(.*)\\cdot10\^\{([+-]?\d+)\}")   # 1e3 as `_mathcore.normalize` writes it


def _number_value(ans: str) -> tuple[float, str] | None:
    """The value and kind ("int", "real", "ratio") of an answer written as one number
    (`_mathcore.number_text`: "x = 12", "12 apples", "\\$12", "1,200", "\\frac{3}{4}", "3/4");
    None for anything else (an expression, a symbol, a list)."""
    found = core.number_text(ans)
    if found is None:
        return None
    kind, s = found
    try:
        if kind == "ratio":
            m = _RATIO.fullmatch(s)
            num, den = next((int(m.group(i)), int(m.group(i + 1))) for i in (2, 4, 6) if m.group(i) is not None)
            v = (-1.0 if m.group(1) == "-" else 1.0) * num / den
        elif (sci := _SCI.fullmatch(s)) is not None:
            v = float(sci.group(1)) * 10.0 ** int(sci.group(2))
        else:
            v = float(s.replace(",", ""))
    except (AttributeError, ValueError, ZeroDivisionError, OverflowError, StopIteration):
        return None
    return (v, kind) if v == v and abs(v) != float("inf") else None


def reference_number(reference) -> tuple[float, str] | None:
    """A reference answer (GSM8K "#### 12" too) as (value, kind) when it is one number, else None."""
    return None if reference is None else _number_value(core.normalize(core.reference_answer(reference)))


def final_number(completion) -> tuple[float, str] | None:
    """The completion's final answer, extracted as `math_accuracy` extracts it, as (value, kind)
    when it is written as one number; None when it is missing, hedged (several different answers,
    a candidate list) or not one number."""
    ex = extract_answer(completion if isinstance(completion, str) else str(completion))
    answers = {core.squash(n): n for n in (core.normalize(x) for x in ex.answers) if n}
    if len(answers) != 1 or ex.hedged:
        return None
    ans = next(iter(answers.values()))
    if len(ans) > core.MAX_ANSWER_CHARS or _DISJ.search(ans):
        return None
    return _number_value(ans)


def closeness(completion: str, reference, *, scale: float = 1.0) -> float | None:
    """1 / (1 + |x - a| / scale) for the completion's final answer x and a numeric reference a;
    1.0 exactly when x = a. 0.0 when the answer is missing, hedged (several different answers, a
    candidate list) or not written as one number (a fraction answers a fraction or a decimal, not
    an integer); None when the reference is not one number."""
    ref = reference_number(reference)
    if ref is None:
        return None
    got = final_number(completion)
    if got is None or (got[1] == "ratio" and ref[1] == "int"):   # as `strict_numbers`: 70/2 for 35 is no answer
        return 0.0
    return 1.0 / (1.0 + abs(got[0] - ref[0]) / scale)


@register("math_closeness", columns=["{answer_column}"])
def math_closeness(prompts, completions, *, answer_column: str = "answer", scale: float = 1.0,
                   **columns) -> list[float | None]:
    """Partial credit for a numeric answer: 1 / (1 + |x - a| / scale), x the final answer as
    `math_accuracy` extracts it, written as one number (an expression scores 0, as under
    `strict_numbers`), a the reference. A shaping term beside `math_accuracy`, not instead of it:
    a group whose answers are all wrong still ranks the near ones above the far ones (None where
    the reference is not a number)."""
    if not scale > 0:
        raise ValueError(f"math_closeness: scale must be > 0, got {scale}")
    refs = read_column("math_closeness", answer_column, columns, len(completions))
    return [closeness(c, r, scale=scale) for c, r in zip(completions, refs)]


# --------------------------------------------------------------------------- stated intermediate values

_STATED = re.compile(r"=\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)(?![\d.]*\s*[*/^×÷]|\d)")


def _step_list(value, n: int) -> list[float]:
    """A row's reference intermediate values: a list/tuple of numbers or numeric strings, a string
    of them separated by ';', or None/empty (no steps). ValueError on anything else."""
    if value is None or value == "" or value == []:
        return []
    items = value.split(";") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"step_values: row {n}: steps must be a list of numbers, got {type(value).__name__}")
    out = []
    for x in items:
        try:
            v = float(str(x).replace(",", "").strip())
        except ValueError:
            raise ValueError(f"step_values: row {n}: step {x!r} is not a number") from None
        if v != v or abs(v) == float("inf"):
            raise ValueError(f"step_values: row {n}: step {x!r} is not finite")
        out.append(v)
    return out


def stated_values(completion: str) -> list[float]:
    """The numbers a completion states as results: what follows an "=" ("9 + 9 = 18" -> 18.0),
    in order, thousands separators dropped. A number that starts a longer expression
    ("= 18 * 2") is not a result."""
    out = []
    for m in _STATED.finditer(completion):
        try:
            out.append(float(m.group(1).replace(",", "")))
        except ValueError:
            continue
    return out


def step_credit(completion: str, steps: list[float], *, answer: float | None = None, slack: int = 2) -> float:
    """Fraction of the reference steps stated as the result of an equation in the completion; 0.0
    when the completion states more than len(steps) + 1 + slack distinct results (listing numbers
    is no way to collect it) and 0.0 when there are no steps (nothing to credit). A step given as
    the final answer is a stop halfway, not a step: it earns nothing unless it is the reference
    `answer` itself."""
    if not steps:
        return 0.0
    text = completion if isinstance(completion, str) else str(completion)
    stated = set(stated_values(text))
    if len(stated) > len(steps) + 1 + slack:
        return 0.0
    close = lambda a, b: a is not None and b is not None and abs(a - b) < 1e-9  # noqa: E731
    want = list(dict.fromkeys(steps))
    hit = [w for w in want if any(close(s, w) for s in stated)]
    if not hit:
        return 0.0
    got = final_number(text)            # read only when a step was stated: the stop-halfway rule
    final = None if got is None else got[0]
    return sum(not close(final, w) or close(w, answer) for w in hit) / len(want)


@register("step_values", columns=["{steps_column}"])
def step_values(prompts, completions, *, steps_column: str = "steps", answer_column: str = "answer",
                slack: int = 2, **columns) -> list[float]:
    """Process shaping for multi-step problems whose intermediate results are known (the
    reference's partial sums; GSM8K's `<<48/2=24>>` annotations): the fraction of a row's
    reference steps that the completion states as the result of an equation ("24 - 5 = 19"), not
    counting a step that is also the final answer (a stop halfway; the reference answer in
    `answer_column`, if the dataset has it, is exempt). Rows without steps score 0.0, so a group
    of them is not ranked by this term. A completion that states more than len(steps) + 1 +
    `slack` distinct results scores 0.0 (a list of numbers is no way to collect it). A shaping
    term beside `math_accuracy`: a right step followed by a wrong final answer still loses to a
    right answer."""
    if not (isinstance(slack, int) and slack >= 0):
        raise ValueError(f"step_values: slack must be an integer >= 0, got {slack!r}")
    rows = read_column("step_values", steps_column, columns, len(completions))
    refs = (read_column("step_values", answer_column, columns, len(completions)) if answer_column in columns
            else [None] * len(completions))
    out = []
    for i, (c, r, a) in enumerate(zip(completions, rows, refs)):
        ref = reference_number(a)
        out.append(step_credit(c, _step_list(r, i), answer=None if ref is None else ref[0], slack=slack))
    return out
