"""Rules on what the policy generates: `length_explosion` (mean completion length jumping to a
multiple of its recent baseline) and `entropy_collapse` (policy entropy fallen far below its early
value or an absolute floor)."""

from __future__ import annotations

import math
import statistics

from pydantic import Field, model_validator

from grpokit.monitor.health.base import Alarm, AlarmConfig, History, _head, _step, _tail, builtin_rule


class LengthExplosionConfig(AlarmConfig):
    factor: float = Field(2.0, gt=1.0)
    """Fire when the recent mean length reaches this multiple of its baseline."""
    recent: int = Field(5, ge=1)
    """Number of latest `completion/length_mean` values whose median is the recent length."""
    baseline_window: int = Field(20, ge=1)
    """Number of values just before the recent ones whose median is the baseline."""
    min_baseline: int = Field(10, ge=1)
    """Fewest baseline values needed before the rule may fire."""
    min_increase: float = Field(8.0, ge=0.0)
    """Smallest absolute growth (tokens) that counts, so tiny lengths doubling do not fire."""

    @model_validator(mode="after")
    def _check(self) -> LengthExplosionConfig:
        if self.min_baseline > self.baseline_window:
            raise ValueError("min_baseline must not exceed baseline_window (the rule could never fire)")
        return self



class EntropyCollapseConfig(AlarmConfig):
    early_window: int = Field(10, ge=1)
    """Number of first `policy/entropy` values whose median is the early entropy."""
    recent: int = Field(5, ge=1)
    """Number of latest values whose median is the current entropy."""
    min_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Fire when the current entropy falls below this fraction of the early entropy."""
    floor: float = Field(0.01, ge=0.0)
    """Fire when the current entropy (nats per token) falls below this absolute floor."""



@builtin_rule(
    "length_explosion", LengthExplosionConfig,
    keys=("completion/length_mean", "completion/clipped_ratio"),
)
def length_explosion(history: History, p: LengthExplosionConfig) -> Alarm | None:
    """Mean completion length jumping to a multiple of its recent baseline.

    Let x be the finite values of ``completion/length_mean``. current = median of the last
    ``recent`` values; baseline = median of the (up to) ``baseline_window`` values just before
    them, of which at least ``min_baseline`` are needed. Fire when
        current ≥ factor · baseline   and   current − baseline ≥ min_increase.
    A sliding baseline ignores slow growth (normal in reasoning RL) and catches jumps. As the
    practitioner's rule "six signals" has it (docs/training.md), this is usually a hole in the
    reward. Value: current / baseline.
    """
    x = _tail(history, "completion/length_mean", p.recent + p.baseline_window)
    if len(x) < p.recent + p.min_baseline:
        return None
    current = statistics.median(x[-p.recent:])
    baseline = statistics.median(x[: -p.recent])
    if baseline <= 0 or current < p.factor * baseline or current - baseline < p.min_increase:
        return None
    clipped = _tail(history, "completion/clipped_ratio", 1)
    extra = f"; {clipped[0]:.0%} of completions hit max_new_tokens" if clipped else ""
    return Alarm(
        "length_explosion", _step(history), p.action,
        f"Mean completion length jumped to {current:.1f} tokens, {current / baseline:.1f}x its "
        f"recent baseline of {baseline:.1f}{extra}.",
        "Usually a reward-function hole: read the longest recent samples, check that truncated "
        "completions (finish_reason=length) earn no reward, and add or strengthen a length or "
        "format penalty.",
        current / baseline,
    )



@builtin_rule("entropy_collapse", EntropyCollapseConfig, keys=("policy/entropy",))
def entropy_collapse(history: History, p: EntropyCollapseConfig) -> Alarm | None:
    """Policy entropy collapsed relative to its early value or below an absolute floor.

    current = median of the last ``recent`` finite ``policy/entropy`` values (needs ``recent``).
    Floor test: current < floor. Relative test (needs early_window + recent values):
    early = median of the first ``early_window`` values; fire when current < min_fraction · early.
    Value: the current entropy.
    """
    recent = _tail(history, "policy/entropy", p.recent)
    if len(recent) < p.recent:
        return None
    current = statistics.median(recent)
    early_vals = _head(history, "policy/entropy", p.early_window + p.recent)
    enough = len(early_vals) == p.early_window + p.recent
    early = statistics.median(early_vals[: p.early_window]) if enough else math.nan
    if current < p.floor:
        msg = f"Policy entropy is {current:.3g} nats/token, below the floor of {p.floor:.3g}."
    elif enough and current < p.min_fraction * early:
        msg = (
            f"Policy entropy fell to {current:.3g} nats/token, {current / early:.0%} of its early "
            f"value {early:.3g}."
        )
    else:
        return None
    return Alarm(
        "entropy_collapse", _step(history), p.action, msg,
        "The policy has stopped exploring: raise the group size G first (rollout.group_size: more "
        "samples per prompt), then the upper clip bound (DAPO clip-higher, algorithm.eps_high); or "
        "lower the learning rate, or add a small entropy bonus (algorithm.entropy_coef, e.g. 0.001, or "
        "algorithm.entropy_target to hold the entropy at a floor). "
        "Do not raise the sampling temperature blindly: for more exploration raise G, not the temperature (the loss's "
        "log-probs use the same temperature, so a hotter sampler also changes what is trained).",
        current,
    )

