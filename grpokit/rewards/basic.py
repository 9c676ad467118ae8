"""The two demo rewards: exact text match and numeric match against the `answer` column.

    exact_match   = 1.0 if completion.strip() == str(answer).strip() else 0.0
    numeric_match = 1.0 if |x - a| <= rel_tol * max(|x|, |a|) else 0.0,  x = last number in the completion

Both read the whole raw completion; `numeric_match` is hackable by ending with the right number
after a wrong derivation (or by listing many numbers: only the last one counts) — use
`math_accuracy` for real math.
"""

from __future__ import annotations

import math
import re

from .registry import read_column, register

_NUM = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators and unicode minus accepted)."""
    found = None
    for m in _NUM.finditer(text):
        s = m.group(0)
        if any(ch.isdigit() for ch in s):
            found = s
    if found is None:
        return None
    try:
        return float(found.replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None


@register("exact_match", columns=["{answer_column}"])
def exact_match(prompts, completions, *, answer_column: str = "answer", **columns) -> list[float | None]:
    """1.0 if the stripped completion equals the stripped answer, else 0.0 (None: no answer)."""
    answers = read_column("exact_match", answer_column, columns, len(completions))
    return [None if a is None else float(str(c).strip() == str(a).strip()) for c, a in zip(completions, answers)]


@register("numeric_match", columns=["{answer_column}"])
def numeric_match(prompts, completions, *, answer_column: str = "answer", rel_tol: float = 1e-6,
                  **columns) -> list[float | None]:
    """1.0 if the last number in the completion equals the answer within `rel_tol`, else 0.0
    (None: the answer is missing or not a number)."""
    answers = read_column("numeric_match", answer_column, columns, len(completions))
    out: list[float | None] = []
    for c, a in zip(completions, answers):
        ref = last_number(str(a)) if a is not None and not isinstance(a, (int, float)) else a
        if ref is None or (isinstance(ref, float) and not math.isfinite(ref)):
            out.append(None)
            continue
        got = last_number(str(c))
        out.append(float(got is not None and math.isclose(got, float(ref), rel_tol=rel_tol, abs_tol=0.0)))
    return out


@register("digit_match", columns=["{answer_column}"])
def digit_match(prompts, completions, *, answer_column: str = "answer", **columns) -> list[float | None]:
    """Partial credit for short exact answers: the fraction of the answer's characters matched
    position by position (right-aligned, like digits of a number), minus the same fraction for
    extra characters: max(0, (matches - extra) / len(answer)). 1.0 only for an exact match.
    Used by the benchmark so that groups have non-zero reward variance."""
    answers = read_column("digit_match", answer_column, columns, len(completions))
    out: list[float | None] = []
    for c, a in zip(completions, answers):
        if a is None or not str(a).strip():
            out.append(None)
            continue
        got, ref = str(c).strip(), str(a).strip()
        hits = sum(x == y for x, y in zip(reversed(got), reversed(ref)))
        extra = max(0, len(got) - len(ref))
        out.append(max(0.0, (hits - extra) / len(ref)))
    return out


@register("env", columns=[])
def env_reward(prompts, completions, **columns) -> list[float | None]:
    """A multi-turn episode's reward from its environment's own state (`reward()` at the episode's
    end, grpokit.rollout.episodes); None (not scored) where the environment gave none or where the
    rollout was not an episode."""
    values = columns.get("env_reward") or [None] * len(completions)
    if len(values) != len(completions):
        raise ValueError(f"env: {len(values)} environment rewards for {len(completions)} completions")
    return [None if v is None or not math.isfinite(float(v)) else float(v) for v in values]
