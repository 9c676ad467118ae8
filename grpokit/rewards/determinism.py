"""Reward determinism check: the same completion must always get the same score.

GRPO's advantages are differences between the scores of a group's samples; a reward that scores
the same completion differently from one call to the next adds noise to every advantage (and a
model learns to farm the lucky draws). `check_determinism` scores a small batch several times
through `RewardSet.score`, the path the trainer uses, and names each reward whose scores moved:

1. score the batch, then score it again in the same process and compare each reward's
   per-sample scores (an unseeded `random`, a cache that changes the result, state kept between
   calls, a reward that fails on one call and not the other);
2. with `fresh_process=True`, retire every checker process (`_workers.restart_all()`: the math
   checkers of math_accuracy / math_accuracy_alt) and score a third time, against the first pass
   (a result that depends on state kept inside a checker process, or on which process answers).
   Skipped when no checker process was running. The code sandbox (code_tests) needs no restart:
   every program already runs in a fresh process tree, so passes 1 and 2 compare two of those.

Equal means: both None (no score, which includes a NaN score and a contained failure), or two
floats with |a - b| <= 1e-12 * max(1, |a|, |b|) (`TOL`): bit-level rounding noise, e.g. a sum
taken in another order, is not noise in the advantages; any real difference is far above that.
A reward that fails (raises, times out, returns malformed scores; the RewardSet contains it and
logs the error) in one pass and not the other is reported; one that fails in every pass is not
(its logged error says enough).

The check scores through a copy of the reward set without its cross-check (same functions,
arguments and time budgets), so it appends nothing to the disagreement dump and leaves the
cross-check's random draws and the error counters of the run's set untouched. It costs two or
three reward calls on the batch; each pass is bounded by the rewards' own time budgets, and
no further pass starts once `budget_s` has been spent (logged on logger `grpokit.rewards`).

    warnings = check_determinism(reward_set, *probe_batch(rows))     # [] when all is well
    warnings = check_rows(reward_set, dataset, prompt_text=encoder.text, max_new_tokens=512)
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

from . import _workers
from .compose import RewardOutput, RewardSet

logger = logging.getLogger("grpokit.rewards")

TOL = 1e-12
"""Scores closer than TOL * max(1, |a|, |b|) are equal (rounding noise, not randomness)."""

DEFAULT_BUDGET_S = 120.0
"""No further pass starts once the check has taken this long (the first pass always runs)."""

_SHOW = 40  # characters of a prompt / completion shown in an example


def check_determinism(reward_set: RewardSet, prompts: list[str], completions: list[str], columns: dict[str, list],
                      *, fresh_process: bool = True, budget_s: float | None = DEFAULT_BUDGET_S) -> list[str]:
    """Score the batch twice (and, with `fresh_process`, once more after restarting the checker
    processes) and return one warning line per reward whose scores differed; [] when none did.

    `prompts`, `completions`, `columns` are laid out as for `RewardSet.score` (see `probe_batch`).
    Never raises for what a reward does (failures are contained by the set); raises ValueError
    for a malformed batch, as `score` does. `budget_s`: no pass starts after this many seconds
    (None: no limit)."""
    shadow = _without_crosscheck(reward_set)
    t0 = time.monotonic()
    first = shadow.score(prompts, completions, columns)
    names = list(first.per_fn)
    warnings: dict[str, str] = {}

    def over_budget(what: str) -> bool:
        spent = time.monotonic() - t0
        if budget_s is not None and spent > budget_s:
            logger.warning("reward determinism check: %s skipped, the check has taken %.0f s (budget %g s)",
                           what, spent, budget_s)
            return True
        return False

    if over_budget("the second scoring"):
        return []
    second = shadow.score(prompts, completions, columns)
    for name in names:
        line = _compare(name, first, second, prompts, completions, fresh=False)
        if line:
            warnings[name] = line
    if fresh_process and not over_budget("the fresh-process scoring"):
        retired = _workers.restart_all()
        if retired:
            third = shadow.score(prompts, completions, columns)
            for name in names:
                if name not in warnings:
                    line = _compare(name, first, third, prompts, completions, fresh=True)
                    if line:
                        warnings[name] = line
        else:
            logger.debug("reward determinism check: no checker process was running, no fresh-process pass")
    logger.debug("reward determinism check: %d rewards, %d samples, %.1f s, %d warnings",
                 len(names), len(completions), time.monotonic() - t0, len(warnings))
    return [warnings[n] for n in names if n in warnings]


def probe_batch(rows: Sequence[dict], n: int = 8, *, prompt_text: Callable | None = None,
                max_new_tokens: int | None = None,
                completion_length: Callable[[str], int] | None = None) -> tuple[list[str], list[str], dict[str, list]]:
    """A small batch to probe the rewards with before any rollout exists: `(prompts, completions,
    columns)` for `check_determinism` / `RewardSet.score`, with at most `n` samples.

    Each of the first rows gives a group of candidate completions: with an answer, the answer as
    plain text, `The answer is $\\boxed{answer}$.`, the same with a wrong answer (0, or 1 when the
    answer is 0; the math checker runs on it) and the empty string; without one, a python block
    that prints 0 (so the code sandbox runs), "0", a sentence and the empty string. Four samples
    per row: fewer than n/4 rows give fewer samples.

    Columns as the trainer passes them (`Trainer.score`): every dataset column except `prompt`
    (None where a row lacks it), plus `completion_length` (by default the number of characters,
    an approximation of the token count; pass `completion_length=` e.g. a tokenizer's length
    to count tokens), `finish_reason` ("eos"), `group_id` (one per row) and `max_new_tokens`
    (default: the longest completion's length, at least 1).
    `prompt_text`: how a row's prompt becomes the text the rewards see (the trainer's
    `PromptEncoder.text`); by default a string as is, chat messages' contents joined by newlines.
    `rows`: a list of dicts or a dataset with `len()` and indexing."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    text = prompt_text or _plain_text
    length = completion_length or len
    picked: list[dict] = []
    prompts: list[str] = []
    completions: list[str] = []
    groups: list[int] = []
    for r in range(len(rows)):
        if len(completions) >= n:
            break
        row = rows[r]
        p = text(row["prompt"])
        for c in _candidates(row)[: n - len(completions)]:
            picked.append(row)
            prompts.append(p)
            completions.append(c)
            groups.append(r)
    if not completions:
        raise ValueError("probe_batch needs at least one row")
    keys = sorted({k for row in picked for k in row if k != "prompt"})
    columns = {k: [row.get(k) for row in picked] for k in keys}
    lengths = [int(length(c)) for c in completions]
    columns.update(completion_length=lengths, finish_reason=["eos"] * len(completions), group_id=groups,
                   max_new_tokens=[int(max_new_tokens or max(1, *lengths))] * len(completions))
    return prompts, completions, columns


def check_rows(reward_set: RewardSet, rows: Sequence[dict], n: int = 8, *, fresh_process: bool = True,
               budget_s: float | None = DEFAULT_BUDGET_S, prompt_text: Callable | None = None,
               max_new_tokens: int | None = None, completion_length: Callable[[str], int] | None = None) -> list[str]:
    """`check_determinism` on `probe_batch(rows, n, ...)`: the one call for the start of a run."""
    batch = probe_batch(rows, n, prompt_text=prompt_text, max_new_tokens=max_new_tokens,
                        completion_length=completion_length)
    return check_determinism(reward_set, *batch, fresh_process=fresh_process, budget_s=budget_s)


# ---------------------------------------------------------------------------- internals


def _without_crosscheck(rs: RewardSet) -> RewardSet:
    """The same rewards (functions, args, resolved time budgets) with their own counters and no
    cross-check: probing must not write the run's disagreement dump or move its random draws."""
    return RewardSet(list(rs.specs), list(rs.fns))


def _plain_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)


def _candidates(row: dict) -> list[str]:
    ans = row.get("answer")
    if ans is None or not str(ans).strip():
        out = ["```python\nprint(0)\n```", "0", "I do not know the answer.", ""]
    else:
        a = str(ans).strip()
        wrong = "1" if a == "0" else "0"
        out = [a, f"The answer is $\\boxed{{{a}}}$.", f"The answer is $\\boxed{{{wrong}}}$.", ""]
    return out


def same(a: float | None, b: float | None) -> bool:
    """Equal scores for the check: both None, both NaN, or floats within `TOL` (relative above 1)."""
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= TOL * max(1.0, abs(a), abs(b))


def _short(s: str) -> str:
    s = str(s)
    return repr(s if len(s) <= _SHOW else s[: _SHOW - 3] + "...")


def _compare(name: str, a: RewardOutput, b: RewardOutput, prompts, completions, *, fresh: bool) -> str | None:
    x, y = a.per_fn[name], b.per_fn[name]
    bad = [i for i, (u, v) in enumerate(zip(x, y)) if not same(u, v)]
    if not bad:
        return None
    n = len(completions)
    err_a = a.metrics.get(f"reward/{name}/errors", 0.0) > 0
    err_b = b.metrics.get(f"reward/{name}/errors", 0.0) > 0
    later = "in fresh checker processes" if fresh else "the second time"
    when = "when scored again in fresh checker processes" if fresh else "when scored twice"
    i = bad[0]
    example = (f"e.g. prompt {_short(prompts[i])}, completion {_short(completions[i])}: "
               f"{x[i]!r} vs {y[i]!r}")
    if err_a != err_b:
        which = f"failed {later} but not the first time" if err_b else f"failed the first time but not {later}"
        return (f"reward {name!r} is not deterministic: it {which} (its error is logged on logger "
                f"grpokit.rewards), so {len(bad)} of {n} samples scored differently {when} ({example}); "
                f"fix the reward")
    advice = ("its score depends on state kept in the checker process; fix the reward" if fresh
              else "seed its randomness or fix the reward")
    return f"reward {name!r} is not deterministic: {len(bad)} of {n} samples scored differently {when} ({example}); {advice}"
