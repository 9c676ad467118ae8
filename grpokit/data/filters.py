"""Sample and group filters applied between scoring and the loss (pure functions over lists).

- `zero_variance_groups`: DAPO's dynamic sampling keeps only groups whose rewards are not all equal
  (arXiv 2503.14476, Eq. 11: 0 < #correct < G), since they carry no advantage signal.
- `proxy_filter`: proxy-based sample filtering (practitioner's rule "Dr. GRPO as practised",
  docs/training.md): a sample whose cheap proxies mark it as noise (too long, truncated, duplicate
  of another sample in its group, non-finite reward, failed format check) is dropped before it
  reaches the loss. Dropped samples leave the group statistics too (their reward becomes NaN ->
  advantage 0).
- `proxy_scores`: the proxies combined into one noise score per sample (`ProxyScore`), dropped at a
  threshold, with a term the single proxies lack: *uninformative*, a completion that scores above
  its group's mean (it would be reinforced) while degenerate: repeated spans (`repetition`),
  format only (tags and a box around nothing else), or an answer without work
  (`work_words` < `min_work_words`). A degenerate completion under its group's mean is kept: its
  negative advantage is what teaches the policy away from it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


def zero_variance_groups(rewards: list[float], group_ids: list[int]) -> dict[int, bool]:
    """Per group id (in order of first appearance): True when every finite reward of the group is
    equal (or fewer than 2 are finite)."""
    vals: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids, strict=True):
        vals.setdefault(g, [])
        if r is not None and math.isfinite(r):
            vals[g].append(r)
    return {g: len(v) < 2 or max(v) - min(v) == 0 for g, v in vals.items()}


@dataclass
class ProxyRules:
    max_length: int | None = None          # drop completions longer than this (tokens)
    drop_truncated: bool = False           # drop completions cut at max_new_tokens
    drop_duplicates: bool = False          # keep only the first of identical completions in a group
    format_reward: str | None = None       # drop samples scoring <= 0 on this reward function
    drop_nonfinite: bool = True            # drop samples whose reward could not be computed


def proxy_filter(rules: ProxyRules, *, completions: list[str], lengths: list[int], finish_reason: list[str],
                 rewards: list[float], group_ids: list[int], per_fn: dict[str, list] | None = None) -> list[str | None]:
    """Per sample: None to keep, or the name of the first proxy that drops it."""
    out: list[str | None] = []
    seen: dict[int, set[str]] = {}
    for i, text in enumerate(completions):
        reason = None
        if rules.drop_nonfinite and (rewards[i] is None or not math.isfinite(rewards[i])):
            reason = "nonfinite_reward"
        elif rules.max_length is not None and lengths[i] > rules.max_length:
            reason = "too_long"
        elif rules.drop_truncated and finish_reason[i] == "length":
            reason = "truncated"
        elif rules.format_reward is not None:
            if per_fn is None or rules.format_reward not in per_fn:
                raise ValueError(f"proxy filter: format_reward '{rules.format_reward}' is not one of the run's rewards")
            v = per_fn[rules.format_reward][i]
            if v is None or v <= 0:
                reason = "format"
        if reason is None and rules.drop_duplicates:
            group = seen.setdefault(group_ids[i], set())
            key = text.strip()
            if key in group:
                reason = "duplicate"
            group.add(key)
        out.append(reason)
    return out


# ---------------------------------------------------------------------- the combined proxy score
PROXIES = ("truncated", "length", "format", "duplicate", "uninformative")
DEFAULT_WEIGHTS = {"truncated": 0.5, "length": 0.5, "format": 0.5, "duplicate": 0.25, "uninformative": 1.5}

_WORD = re.compile(r"[A-Za-z]+|\d+(?:\.\d+)?|[^\sA-Za-z\d]")
_TAG = re.compile(r"</?[A-Za-z_][A-Za-z0-9_-]*>")
_EMPTY_PAIR = re.compile(r"<([A-Za-z_][A-Za-z0-9_-]*)>\s*</\1>")
_BOX = re.compile(r"\\(?:boxed|fbox)\{")


def words(text: str) -> list[str]:
    """Words, numbers and single punctuation marks of `text`, lower-cased."""
    return [w.lower() for w in _WORD.findall(text)]


def repetition(text: str) -> float:
    """How much of `text` repeats itself, in [0, 1]: 1 - distinct n-grams / n-grams over its words
    and numbers (punctuation aside), with n = 1 for up to 7 words, 2 up to 15, 3 up to 31, else 4
    (a short text repeating one number, "46 46 46 46", is as repetitive as a long one looping over
    a sentence; markup tags are not words). Below 4 words: 0."""
    w = [x for x in words(_TAG.sub(" ", text)) if x[0].isalnum()]
    if len(w) < 4:
        return 0.0
    n = 1 if len(w) < 8 else 2 if len(w) < 16 else 3 if len(w) < 32 else 4
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def _strip_boxes(text: str) -> tuple[str, int]:
    """`text` without its \\boxed{...}/\\fbox{...} spans (nested braces), and how many there were."""
    out, i, boxes = [], 0, 0
    for m in _BOX.finditer(text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i, boxes = j, boxes + 1
    out.append(text[i:])
    return "".join(out), boxes


def work_words(text: str) -> int:
    """Words of `text` outside its markup (tags, boxed answers) and outside its last number (the
    answer when there is no box): what is left to show the work."""
    body, boxes = _strip_boxes(_TAG.sub(" ", text))
    w = [x for x in words(body) if x.isalnum() or x.replace(".", "", 1).isdigit()]
    if not boxes:
        nums = [k for k, x in enumerate(w) if x.replace(".", "", 1).isdigit()]
        if nums:
            del w[nums[-1]]
    return len(w)


def format_only(text: str) -> bool:
    """An empty tag pair and no other content than the answer: "<think></think><answer>5</answer>"
    (the rules' "a 'must contain thinking tags' rule teaches empty tags"). A tagged or boxed answer
    alone, "<answer>5</answer>", is an answer without work, counted by `min_work_words`."""
    return bool(_EMPTY_PAIR.search(text)) and work_words(text) == 0


def degeneracy(text: str, min_work_words: int = 0) -> float:
    """How degenerate a completion is, in [0, 1]: the largest of its repetition, 1 if it is format
    only, 1 if it shows fewer than `min_work_words` words of work (0: not checked)."""
    d = repetition(text)
    if format_only(text) or (min_work_words and work_words(text) < min_work_words):
        d = 1.0
    return d


@dataclass
class ProxyScore:
    """The combined proxy score: drop a sample when sum_k weights[k] * proxy_k >= threshold, with
    proxy_k in [0, 1]:
      truncated      1 when cut at max_new_tokens
      length         0 up to half the length limit (`max_length`, else max_new_tokens), rising to 1
                     at it; 0 for a truncated completion (its length is the cut, counted once above)
      format         1 when `format_reward` scores <= 0
      duplicate      1 for a repeat of an earlier completion in its group
      uninformative  `degeneracy` of a completion whose reward is above its group's mean, else 0
    With the default weights one strong sign drops a sample (a rewarded completion that is format
    only, or that repeats itself: repetition >= 2/3), two weaker ones together do (truncated, or at
    the length limit, with a failed format check), one weak one does not (truncated alone, a
    duplicate alone)."""
    threshold: float = 1.0
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    max_length: int | None = None
    format_reward: str | None = None
    min_work_words: int = 0


def proxy_scores(rule: ProxyScore, *, completions: list[str], lengths: list[int], finish_reason: list[str],
                 rewards: list[float], group_ids: list[int], max_new_tokens: int,
                 per_fn: dict[str, list] | None = None) -> list[dict[str, float]]:
    """Per sample: each proxy's value and `score`, the weighted sum."""
    limit = rule.max_length or max_new_tokens
    means: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        if r is not None and math.isfinite(r):
            means.setdefault(g, []).append(r)
    mean = {g: sum(v) / len(v) for g, v in means.items()}
    if rule.format_reward is not None and (per_fn is None or rule.format_reward not in per_fn):
        raise ValueError(f"proxy score: format_reward '{rule.format_reward}' is not one of the run's rewards")
    seen: dict[int, set[str]] = {}
    out = []
    for i, text in enumerate(completions):
        r = rewards[i]
        rewarded = r is not None and math.isfinite(r) and group_ids[i] in mean and r > mean[group_ids[i]]
        key, group = text.strip(), seen.setdefault(group_ids[i], set())
        fmt = per_fn[rule.format_reward][i] if rule.format_reward is not None else 1.0
        p = {"truncated": float(finish_reason[i] == "length"),
             "length": 0.0 if finish_reason[i] == "length" else min(1.0, max(0.0, 2.0 * lengths[i] / max(limit, 1) - 1.0)),
             "format": float(fmt is None or fmt <= 0),
             "duplicate": float(key in group),
             "uninformative": degeneracy(text, rule.min_work_words) if rewarded else 0.0}
        group.add(key)
        p["score"] = sum(rule.weights.get(k, 0.0) * p[k] for k in PROXIES)
        out.append(p)
    return out
