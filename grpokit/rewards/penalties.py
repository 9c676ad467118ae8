"""Penalties: registered rewards that are <= 0, each with its own weight in config.

    soft_overlong      DAPO Eq. 13 (Yu et al. 2025, §3.4), L = completion tokens, c = cache:
                       0 if L <= L_max - c;  ((L_max - c) - L) / c if L_max - c < L <= L_max;  -1 if L > L_max
                       (times `penalty_factor`, verl's name; 1.0 in the paper)
    ngram_repetition   -(1 - distinct n-grams / n-grams), words by default (0: no repeat, -> -1: a loop)
    length_group       Kimi k1.5 length penalty (arXiv 2501.12599 §2.3.3), per group:
                       lambda_i = 0.5 - (L_i - L_min) / (L_max - L_min)  (0 when all lengths are equal);
                       lambda_i for correct samples, min(0, lambda_i) for the others
    format_violation   -penalty when the completion breaks the format (`format.CHECKS`), else 0

Overlong *filtering* is not a reward: the trainer masks truncated completions (finish_reason ==
"length", see `is_truncated`) out of the loss when its flag is on (TRL: mask_truncated_completions).
"""

from __future__ import annotations

import re
from collections import defaultdict

from .format import CHECKS
from .registry import register
from .user import resolve


def is_truncated(finish_reason) -> bool:
    """True for a completion cut by the token limit (what overlong filtering masks)."""
    return finish_reason == "length"


def _column(name: str, col: str, value, n: int) -> list:
    if value is None:
        raise KeyError(f"{name} needs the column {col!r}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name}: column {col!r} has {len(value)} entries for {n} completions")
    return value


def soft_overlong_penalty(length: int, max_len: int, cache: int, penalty_factor: float = 1.0) -> float:
    """DAPO Eq. 13 for one completion of `length` tokens."""
    if cache <= 0 or cache > max_len:
        raise ValueError(f"soft_overlong: need 0 < cache <= max_len, got cache={cache}, max_len={max_len}")
    start = max_len - cache
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / cache * penalty_factor
    return -1.0 * penalty_factor


@register("soft_overlong")
def soft_overlong(prompts, completions, *, max_len: int | None = None, cache: int | None = None,
                  penalty_factor: float = 1.0, completion_length=None, max_new_tokens=None,
                  **columns) -> list[float]:
    """DAPO soft overlong punishment. max_len defaults to the `max_new_tokens` column (L_max);
    cache defaults to 20% of max_len (the paper's 4,096 of 20,480)."""
    n = len(completions)
    lengths = _column("soft_overlong", "completion_length", completion_length, n)
    caps = [max_len] * n if max_len is not None else _column("soft_overlong", "max_new_tokens", max_new_tokens, n)
    out = []
    for length, cap in zip(lengths, caps):
        c = cache if cache is not None else max(1, round(0.2 * cap))
        out.append(soft_overlong_penalty(int(length), int(cap), int(c), penalty_factor))
    return out


def repetition_rate(text: str, n: int = 4, unit: str = "word") -> float:
    """1 - distinct n-grams / n-grams (0 when there are fewer than n tokens)."""
    toks = re.findall(r"\S+", text) if unit == "word" else list(text)
    grams = [tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@register("ngram_repetition")
def ngram_repetition(prompts, completions, *, n: int = 4, unit: str = "word", **columns) -> list[float]:
    """Minus the fraction of repeated n-grams (`unit`: "word" or "char")."""
    if unit not in ("word", "char") or n < 1:
        raise ValueError(f"ngram_repetition: unit must be 'word' or 'char' and n >= 1, got {unit!r}, {n}")
    return [-repetition_rate(c, n, unit) for c in completions]


def _verifier_columns(args) -> list[str]:
    """length_group reads what its verifier reads (and an unknown verifier is named at start)."""
    if args.get("verifier") is None:
        return []
    from .user import required_columns, resolve

    return required_columns(resolve(args["verifier"]), args.get("verifier_args") or {})


@register("length_group", columns=_verifier_columns)
def length_group(prompts, completions, *, verifier: str | None = None, verifier_args: dict | None = None,
                 reward_short: bool = False, completion_length=None, group_id=None,
                 **columns) -> list[float | None]:
    """Kimi k1.5 length penalty within each group (`group_id`; the prompt text if absent).

    verifier: a registered reward deciding correctness (score >= 0.5), e.g. "math_accuracy";
    correct samples get lambda, the others min(0, lambda). Without a verifier every sample gets
    min(0, lambda) (a pure penalty for being longer than the group's shortest), or lambda with
    `reward_short=True` (then short wrong answers are paid too: a known hole).
    """
    n = len(completions)
    lengths = list(completion_length) if completion_length is not None else [len(c) for c in completions]
    groups = list(group_id) if group_id is not None else list(prompts)
    if len(lengths) != n or len(groups) != n:
        raise ValueError("length_group: completion_length / group_id must have one entry per completion")
    members = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    lam = [0.0] * n
    for idx in members.values():
        lo, hi = min(lengths[i] for i in idx), max(lengths[i] for i in idx)
        for i in idx:
            lam[i] = 0.5 - (lengths[i] - lo) / (hi - lo) if hi > lo else 0.0
    if verifier is None:
        return lam if reward_short else [min(0.0, x) for x in lam]
    cols = dict(columns, completion_length=completion_length, group_id=group_id)
    correct = resolve(verifier)(prompts, completions, **(verifier_args or {}), **cols)
    return [None if c is None else (x if c >= 0.5 else min(0.0, x)) for x, c in zip(lam, correct)]


@register("format_violation")
def format_violation(prompts, completions, *, format: str = "think_answer", penalty: float = 1.0,  # noqa: A002
                     think_tag: str = "think", answer_tag: str = "answer", think_in_prompt: bool = False,
                     **columns) -> list[float]:
    """-penalty for a completion that breaks `format` ("think_answer", "boxed" or "code"), else 0."""
    if format not in CHECKS:
        raise ValueError(f"format_violation: unknown format {format!r}; options: {sorted(CHECKS)}")
    if format == "think_answer":
        check = lambda c: CHECKS[format](c, think_tag=think_tag, answer_tag=answer_tag,  # noqa: E731
                                         think_in_prompt=think_in_prompt)
    else:
        check = CHECKS[format]
    return [0.0 if check(c)[0] else -float(penalty) for c in completions]
