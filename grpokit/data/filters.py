"""Sample and group filters applied between scoring and the loss (pure functions over lists).

- `zero_variance_groups`: DAPO's dynamic sampling keeps only groups whose rewards are not all equal
  (arXiv 2503.14476, Eq. 11: 0 < #correct < G), since they carry no advantage signal.
- `proxy_filter`: proxy-based sample filtering (practitioner's rule "Dr. GRPO as practised",
  docs/training.md): a sample whose cheap proxies mark it as noise (too long, truncated, duplicate
  of another sample in its group, non-finite reward, failed format check) is dropped before it
  reaches the loss. Dropped samples leave the group statistics too (their reward becomes NaN ->
  advantage 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
