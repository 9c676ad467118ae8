"""Training-health alarms: small pure rules over the metric history, and the monitor that runs them.

A *rule* is a plain function ``rule(history, params) -> Alarm | None``. ``history`` is the list of
metric dicts logged so far, oldest first, each with a ``"step"`` key (the rows of
``metrics.jsonl``); ``params`` is that rule's own small config model. Rules read only the metrics
they declare, skip missing and non-finite values, and each needs a minimum amount of history before
it can fire, so the noise of a healthy short run stays quiet. Their formulas are in their
docstrings and in ``docs/metrics.md``.

``HealthMonitor`` is the orchestration: it keeps the history, runs every enabled rule after each
step, appends each alarm to ``RUN_DIR/alarms.jsonl``, prints each alarm name once (with its advice),
and says whether an alarm configured ``stop`` has fired.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpokit._names import did_you_mean
from grpokit.monitor.sinks import truncate_jsonl

Action = Literal["warn", "stop", "off"]
History = Sequence[Mapping[str, Any]]

ALARMS_FILE = "alarms.jsonl"


@dataclasses.dataclass(frozen=True)
class Alarm:
    """One firing of a rule at one step. ``severity`` is the rule's configured action."""

    name: str
    step: int
    severity: Literal["warn", "stop"]
    message: str
    advice: str
    value: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alarm:
        value = d.get("value")
        return cls(
            name=str(d["name"]),
            step=int(d.get("step", -1)),
            severity="stop" if d.get("severity") == "stop" else "warn",
            message=str(d.get("message", "")),
            advice=str(d.get("advice", "")),
            value=float(value) if isinstance(value, (int, float)) else math.nan,
        )


# --------------------------------------------------------------------------------------------
# Config


class _Strict(BaseModel):
    """Forbids unknown keys, naming the key and the closest valid one."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            valid = list(cls.model_fields)
            for key in data:
                if key not in valid:
                    hint = did_you_mean(key, valid) or f"; valid keys: {valid}"
                    raise ValueError(f"unknown key {key!r} in {cls.__name__}{hint}")
        return data


class AlarmConfig(_Strict):
    action: Action = "warn"
    """What a firing does: 'warn' logs and prints it, 'stop' also asks the trainer to stop,
    'off' disables the rule."""


class KLClimbingConfig(AlarmConfig):
    window: int = Field(20, ge=4)
    """Number of most recent `kl/ref` values the trend test looks at (also its minimum history)."""
    min_tau: float = Field(0.5, ge=-1.0, le=1.0)
    """Kendall's tau over the window at or above which the rise counts as steady."""
    rise_factor: float = Field(1.5, gt=1.0)
    """The median of the window's last quarter must be at least this multiple of its first."""
    min_kl: float = Field(0.05, ge=0.0)
    """KL (nats per token) below which a rising trend is ignored (early growth from zero)."""
    kl_high: float | None = Field(None, gt=0.0)
    """Upper bound of the KL controller's target range; None disables the level test. The trainer
    copies it from its KL controller config."""
    unit: Literal["token", "sequence"] = "token"
    """The unit of `kl_high`: `token` compares it with `kl/ref`, `sequence` with `kl/ref_seq` (the
    KL of a whole completion). The trainer copies it from `algorithm.kl.target_unit`."""
    high_steps: int = Field(10, ge=1)
    """Consecutive `kl/ref` values above `kl_high` that fire the level test (an adaptive controller
    needs a few steps to pull KL back into its band, so this is not 1)."""


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


class NoSignalConfig(AlarmConfig):
    window: int = Field(10, ge=1)
    """Number of latest values (and minimum history) the medians are taken over."""
    adv_std_eps: float = Field(1e-4, ge=0.0)
    """`advantage/std` at or below this counts as zero."""
    max_frac_zero_std: float = Field(0.95, gt=0.0, le=1.0)
    """`group/frac_zero_std` at or above this counts as no signal."""


class RewardHackingConfig(AlarmConfig):
    eval_window: int = Field(8, ge=2)
    """Most recent eval points (`eval/pass@1`) the trends are fitted over. Greedy pass@1 on a small
    held-out set jumps by ~0.1 between evals in healthy runs; over 5 points such a jump read as a
    fall (tests/monitor/test_hacking.py), over 8 it does not."""
    min_eval_points: int = Field(3, ge=2)
    """Fewest eval points (each with training reward before it) needed for the trend test."""
    reward_smooth: int = Field(20, ge=1)
    """Number of `reward/mean` values up to each eval step that are averaged into its reward level
    (with 8 prompts a step, 10 steps left enough noise for a 0.1 'rise' in healthy runs)."""
    min_reward_rise: float = Field(0.1, ge=0.0)
    """Fitted rise of the training reward (reward units) over the eval span that counts as rising."""
    eval_flat: float = Field(0.02, ge=0.0)
    """Fitted pass@1 change at or below this (0..1 scale) counts as flat or falling."""
    max_disagreement: float = Field(0.1, ge=0.0)
    """Mean `reward/checker_disagreement` above this fires the checker test."""
    disagreement_window: int = Field(3, ge=1)
    """Number of latest `reward/checker_disagreement` values averaged (and needed) by that test."""

    @model_validator(mode="after")
    def _check(self) -> RewardHackingConfig:
        if self.min_eval_points > self.eval_window:
            raise ValueError("min_eval_points must not exceed eval_window (the test could never fire)")
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


class RefDriftConfig(AlarmConfig):
    tolerance: float = Field(1e-4, ge=0.0)
    """Largest allowed `ref/integrity_drift` (nats); the trainer passes `guard.ref_tolerance`."""


class RewardsMissingConfig(AlarmConfig):
    max_missing: float = Field(0.5, gt=0.0, le=1.0)
    """Fire when at least this fraction of a step's completions has no reward
    (`reward/total_nan_frac`: a reward returned None, raised or timed out)."""


class HealthConfig(_Strict):
    """Per-alarm settings (the field names are the rule names) and the history the rules see."""

    history_head: int = Field(50, ge=0)
    """First steps always kept in the history (the early baselines, e.g. early entropy)."""
    history_limit: int = Field(5000, ge=100)
    """Most recent steps kept besides the head; older ones are dropped so an update and the
    monitor's checkpoint state stay small. Every default rule looks back far less than this."""

    kl_climbing: KLClimbingConfig = Field(default_factory=KLClimbingConfig)
    """KL to the reference rising steadily, or above the controller's target range."""
    length_explosion: LengthExplosionConfig = Field(default_factory=LengthExplosionConfig)
    """Mean completion length jumping to a multiple of its recent baseline."""
    no_signal: NoSignalConfig = Field(default_factory=NoSignalConfig)
    """Groups whose rewards are all equal, so advantages carry no signal."""
    reward_hacking: RewardHackingConfig = Field(default_factory=RewardHackingConfig)
    """Training reward rising while held-out accuracy does not, or answer checkers disagreeing."""
    entropy_collapse: EntropyCollapseConfig = Field(default_factory=EntropyCollapseConfig)
    """Policy entropy fallen far below its early value or an absolute floor."""
    ref_drift: RefDriftConfig = Field(default_factory=RefDriftConfig)
    """Reference log-probs changing although the reference must stay frozen."""
    rewards_missing: RewardsMissingConfig = Field(default_factory=RewardsMissingConfig)
    """Most of a step's completions without a reward (None, an error or a timeout)."""


# --------------------------------------------------------------------------------------------
# Registry and helpers


@dataclasses.dataclass(frozen=True)
class Rule:
    fn: Callable[[History, Any], Alarm | None]
    params_type: type[AlarmConfig]
    keys: tuple[str, ...]
    """The metrics the rule reads: the monitor keeps only these, and the report marks their plots.
    A key may hold `*` (`reward/*/none_frac`: every reward's), matched with fnmatch."""


RULES: dict[str, Rule] = {}


def register_rule(name: str, params_type: type[AlarmConfig], keys: Iterable[str]):
    """Register ``fn(history, params) -> Alarm | None`` under ``name``."""

    def deco(fn):
        RULES[name] = Rule(fn, params_type, tuple(keys))
        return fn

    return deco


def _num(v: Any) -> float | None:
    """v as a finite float, or None (missing, NaN, inf, bool, non-numeric)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _tail(history: History, key: str, n: int, end: int | None = None) -> list[float]:
    """The last ``n`` finite values of ``key`` in ``history[:end]``, oldest first."""
    out: list[float] = []
    stop = len(history) if end is None else end
    for i in range(stop - 1, -1, -1):
        v = _num(history[i].get(key))
        if v is not None:
            out.append(v)
            if len(out) == n:
                break
    out.reverse()
    return out


def _head(history: History, key: str, n: int) -> list[float]:
    """The first ``n`` finite values of ``key`` in ``history``."""
    out: list[float] = []
    for entry in history:
        v = _num(entry.get(key))
        if v is not None:
            out.append(v)
            if len(out) == n:
                break
    return out


def _step(history: History) -> int:
    return int(history[-1].get("step", len(history) - 1)) if history else -1


def kendall_tau(x: Sequence[float]) -> float:
    """Kendall's tau-a of ``x`` against its index: (concordant − discordant pairs) / (n(n−1)/2)."""
    a = np.asarray(x, dtype=float)  # [n]
    n = a.size
    if n < 2:
        return 0.0
    sign = np.sign(a[None, :] - a[:, None])  # [n, n], +1 where a later value is larger
    return float(np.triu(sign, k=1).sum() / (n * (n - 1) / 2))


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (0 when xs are all equal)."""
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    dx = x - x.mean()
    den = float((dx * dx).sum())
    return float((dx * (y - y.mean())).sum() / den) if den > 0 else 0.0


# --------------------------------------------------------------------------------------------
# Rules


@register_rule("kl_climbing", KLClimbingConfig, keys=("kl/ref", "kl/ref_seq"))
def kl_climbing(history: History, p: KLClimbingConfig) -> Alarm | None:
    """KL to the reference climbing steadily, or held above the controller's target range.

    Let x be the last ``window`` (W) finite values of ``kl/ref`` and q = W // 4.
    Trend test (needs W values): fire when
        tau(x) ≥ min_tau   and   median(x[-q:]) ≥ rise_factor · median(x[:q])
        and   median(x[-q:]) ≥ min_kl,
    with tau Kendall's tau-a of x against time (1 = strictly increasing).
    Level test (only when ``kl_high`` is set): fire when the last ``high_steps`` finite values are
    all > kl_high.  Value: the latest KL.
    """
    advice = (
        "The policy is moving away from the reference faster than the KL penalty holds it: raise the "
        "KL coefficient (or use the adaptive controller), lower the learning rate, or tighten the "
        "clip range."
    )
    if p.kl_high is not None:
        key = "kl/ref_seq" if p.unit == "sequence" else "kl/ref"
        high = _tail(history, key, p.high_steps)
        if len(high) == p.high_steps and min(high) > p.kl_high:
            return Alarm(
                "kl_climbing", _step(history), p.action,
                f"KL to the reference ({key}) has been above the target bound kl_high={p.kl_high:.3g} "
                f"for the last {p.high_steps} steps (now {high[-1]:.3g}).",
                advice, high[-1],
            )
    x = _tail(history, "kl/ref", p.window)
    if len(x) < p.window:
        return None
    q = max(1, p.window // 4)
    first, last = statistics.median(x[:q]), statistics.median(x[-q:])
    tau = kendall_tau(x)
    if tau >= p.min_tau and last >= p.rise_factor * first and last >= p.min_kl:
        return Alarm(
            "kl_climbing", _step(history), p.action,
            f"KL to the reference (kl/ref) rose steadily from {first:.3g} to {last:.3g} over the "
            f"last {p.window} steps (Kendall tau {tau:.2f}).",
            advice, x[-1],
        )
    return None


@register_rule(
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


@register_rule(
    "no_signal", NoSignalConfig,
    keys=("advantage/std", "group/frac_zero_std", "reward/mean"),
)
def no_signal(history: History, p: NoSignalConfig) -> Alarm | None:
    """Advantages carrying no learning signal.

    Over the last ``window`` finite values of each metric, fire when
        median(advantage/std) ≤ adv_std_eps   or   median(group/frac_zero_std) ≥ max_frac_zero_std.
    Each test needs ``window`` values of its metric. Medians let one lucky batch not hide a dead
    stretch. Value: the median fraction of zero-std groups (1.0 when only advantage/std is logged).
    """
    adv = _tail(history, "advantage/std", p.window)
    frac = _tail(history, "group/frac_zero_std", p.window)
    dead_adv = len(adv) == p.window and statistics.median(adv) <= p.adv_std_eps
    dead_frac = len(frac) == p.window and statistics.median(frac) >= p.max_frac_zero_std
    if not (dead_adv or dead_frac):
        return None
    value = statistics.median(frac) if len(frac) == p.window else 1.0
    what = (
        f"{value:.0%} of groups had all-equal rewards" if dead_frac
        else f"advantage std was ~0 (median {statistics.median(adv):.2g})"
    )
    reward = _tail(history, "reward/mean", p.window)
    why = ""
    if reward:
        level = statistics.median(reward)
        why = f" (median reward {level:.3g}: prompts look {'too easy' if level >= 0.5 else 'too hard'})"
    return Alarm(
        "no_signal", _step(history), p.action,
        f"No learning signal: over the last {p.window} steps {what}{why}.",
        "Every completion of a group gets the same reward, so advantages are zero: use a larger "
        "group size G, harder prompts (or easier ones if all fail), or dynamic sampling that drops "
        "zero-variance groups.",
        value,
    )


def held_out_metric(history: History) -> str:
    """The held-out accuracy the reward-hacking trend test follows: `eval/mean@k` (sampled at the
    rollout temperature, like the training reward) when the run logs it, else `eval/pass@1`
    (greedy). A policy that only sharpens raises its sampled reward without changing its greedy
    answers, so against greedy pass@1 a healthy run can look like a hacked one."""
    if any(_num(row.get("eval/mean@k")) is not None for row in history):
        return "eval/mean@k"
    return "eval/pass@1"


def _eval_points(history: History, p: RewardHackingConfig, key: str) -> tuple[list[float], list[float], list[float]]:
    """(steps, held-out accuracy `key`, reward level) for up to the last ``eval_window`` eval points."""
    steps: list[float] = []
    passes: list[float] = []
    rewards: list[float] = []
    for i in range(len(history) - 1, -1, -1):
        v = _num(history[i].get(key))
        if v is None:
            continue
        r = _tail(history, "reward/mean", p.reward_smooth, end=i + 1)
        if r:
            steps.append(float(history[i].get("step", i)))
            passes.append(v)
            rewards.append(sum(r) / len(r))
            if len(steps) == p.eval_window:
                break
    return steps[::-1], passes[::-1], rewards[::-1]


@register_rule(
    "reward_hacking", RewardHackingConfig,
    keys=("reward/mean", "eval/pass@1", "eval/mean@k", "reward/checker_disagreement"),
)
def reward_hacking(history: History, p: RewardHackingConfig) -> Alarm | None:
    """Training reward rising while held-out accuracy does not, or answer checkers disagreeing.

    Trend test: take the last ``eval_window`` steps s_k with a finite held-out accuracy p_k (at
    least ``min_eval_points``): ``eval/mean@k`` when the run logs it, else ``eval/pass@1``
    (`held_out_metric`); the reward level r_k is the mean of the last ``reward_smooth``
    finite ``reward/mean`` values at or before s_k. With least-squares slopes b_r, b_p over
    s and span = s_last − s_first, fire when
        b_r · span ≥ min_reward_rise   and   b_p · span ≤ eval_flat.
    Checker test: fire when the mean of the last ``disagreement_window`` finite
    ``reward/checker_disagreement`` values is > max_disagreement.
    Value: the fitted reward rise (trend test) or the mean disagreement (checker test).
    """
    advice = (
        "The policy may be exploiting the reward instead of solving the task: read recent "
        "high-reward samples, tighten the answer checker (look at the cases where checkers "
        "disagree), and keep a held-out evaluation."
    )
    key = held_out_metric(history)
    steps, passes, rewards = _eval_points(history, p, key)
    if len(steps) >= p.min_eval_points:
        span = steps[-1] - steps[0]
        d_reward = _slope(steps, rewards) * span
        d_pass = _slope(steps, passes) * span
        if d_reward >= p.min_reward_rise and d_pass <= p.eval_flat:
            trend = "fell" if d_pass < -p.eval_flat else "stayed flat"
            return Alarm(
                "reward_hacking", _step(history), p.action,
                f"Training reward rose by {d_reward:.3g} over the last {len(steps)} evals "
                f"(steps {steps[0]:.0f}-{steps[-1]:.0f}) while held-out "
                f"{key.removeprefix('eval/')} {trend} "
                f"({d_pass:+.3g}).",
                advice, d_reward,
            )
    dis = _tail(history, "reward/checker_disagreement", p.disagreement_window)
    if len(dis) == p.disagreement_window:
        mean = sum(dis) / len(dis)
        if mean > p.max_disagreement:
            return Alarm(
                "reward_hacking", _step(history), p.action,
                f"Answer checkers disagree on {mean:.0%} of completions (mean over the last "
                f"{len(dis)} steps; limit {p.max_disagreement:.0%}).",
                advice, mean,
            )
    return None


@register_rule("entropy_collapse", EntropyCollapseConfig, keys=("policy/entropy",))
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
        "lower the learning rate, or add a small entropy bonus. Do not raise the sampling "
        "temperature blindly: for more exploration raise G, not the temperature (the loss's "
        "log-probs use the same temperature, so a hotter sampler also changes what is trained).",
        current,
    )


@register_rule("ref_drift", RefDriftConfig, keys=("ref/integrity_drift",))
def ref_drift(history: History, p: RefDriftConfig) -> Alarm | None:
    """Reference log-probs drifting: fire when the latest step logged ``ref/integrity_drift`` and
    it is > tolerance or not finite (NaN/inf reference log-probs are broken too).

    It is an exact integrity check (the reference is frozen), so one reading suffices; the probe
    runs every few steps, and the rule fires once per bad reading, not on the steps between.
    Value: the drift.
    """
    v = history[-1].get("ref/integrity_drift") if history else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    drift = float(v)
    if drift <= p.tolerance:  # NaN compares False: it fires
        return None
    what = f"moved by up to {drift:.3g} nats" if math.isfinite(drift) else f"became {drift}"
    return Alarm(
        "ref_drift", _step(history), p.action,
        f"Reference log-probs {what} on the probe batch (tolerance {p.tolerance:.3g}); KL to the "
        "reference is no longer trustworthy.",
        "The reference must stay frozen: check that its weights (or the LoRA base) are not updated "
        "or changed in place, and that it runs with the same dtype; resume from the last good "
        "checkpoint.",
        drift,
    )


@register_rule("rewards_missing", RewardsMissingConfig, keys=("reward/total_nan_frac", "reward/*/none_frac"))
def rewards_missing(history: History, p: RewardsMissingConfig) -> Alarm | None:
    """Most of the latest step's completions without a reward: fire when its
    ``reward/total_nan_frac`` ≥ max_missing. A completion without a reward gets advantage 0, so
    such a step teaches (almost) nothing, however healthy its other signals look. Like
    ``ref_drift`` it reads one step and fires on each step that qualifies; the message names the
    rewards that scored None (``reward/<name>/none_frac``). Value: the fraction missing.
    """
    last = history[-1] if history else {}
    frac = _num(last.get("reward/total_nan_frac"))
    if frac is None or frac < p.max_missing:
        return None
    culprits = sorted(((v, k[len("reward/"):-len("/none_frac")]) for k, v in last.items()
                       if k.startswith("reward/") and k.endswith("/none_frac") and (_num(v) or 0) > 0), reverse=True)
    who = ", ".join(f"{name} {v:.0%}" for v, name in culprits) or "no single reward"
    return Alarm(
        "rewards_missing", _step(history), p.action,
        f"{frac:.0%} of this step's completions have no reward (None per reward: {who}).",
        "A reward returned None, raised or timed out for these samples, so they get no advantage and "
        "teach nothing: read the first traceback logged by grpokit.rewards, check that every row has "
        "the columns the reward reads (e.g. `answer`; data.answer_field renames one) and that the "
        "reference answers parse, and watch reward/<name>/errors.",
        frac,
    )


# --------------------------------------------------------------------------------------------
# Summary and monitor


@dataclasses.dataclass
class AlarmTally:
    """What the summary needs about one alarm name: first and latest firing, and a count."""

    first: Alarm
    last: Alarm
    count: int = 1
    stopped: bool = False

    def add(self, alarm: Alarm) -> None:
        if alarm.step < self.first.step:
            self.first = alarm
        if alarm.step >= self.last.step:
            self.last = alarm
        self.count += 1
        self.stopped = self.stopped or alarm.severity == "stop"


def tally_alarms(alarms: Iterable[Alarm | Mapping[str, Any]]) -> dict[str, AlarmTally]:
    """Alarms (objects or alarms.jsonl rows) grouped by name, in order of first firing."""
    tallies: dict[str, AlarmTally] = {}
    for a in alarms:
        _add(tallies, a if isinstance(a, Alarm) else Alarm.from_dict(a))
    return dict(sorted(tallies.items(), key=lambda kv: kv[1].first.step))


def _add(tallies: dict[str, AlarmTally], alarm: Alarm) -> None:
    if alarm.name in tallies:
        tallies[alarm.name].add(alarm)
    else:
        tallies[alarm.name] = AlarmTally(alarm, alarm, 1, alarm.severity == "stop")


def summarize_alarms(
    alarms: Iterable[Alarm | Mapping[str, Any]] | Mapping[str, AlarmTally],
    n_steps: int | None = None,
) -> str:
    """A plain-words health summary of alarms (objects, alarms.jsonl rows, or a tally)."""
    tallies = alarms if isinstance(alarms, Mapping) else tally_alarms(alarms)
    span = f" in {n_steps} steps" if n_steps is not None else ""
    if not tallies:
        return f"Healthy: no alarm fired{span}."
    n = len(tallies)
    lines = [f"{n} alarm{'s' if n > 1 else ''} fired{span}."]
    stops = [name for name, t in tallies.items() if t.stopped]
    if stops:
        lines[0] += f" Training was asked to stop by: {', '.join(stops)}."
    for name, t in tallies.items():
        times = "once" if t.count == 1 else f"{t.count} times"
        when = (
            f"at step {t.first.step}" if t.count == 1
            else f"from step {t.first.step} to step {t.last.step}"
        )
        lines.append(
            f"- {name} ({t.last.severity}) fired {times}, {when}. {t.last.message} "
            f"Advice: {t.last.advice}"
        )
    return "\n".join(lines)


class HealthMonitor:
    """Runs the enabled rules after each step; logs, prints once, and tracks ``stop`` alarms.

    The history keeps only ``step`` and the metrics some registered rule reads, and only the first
    ``history_head`` plus the last ``history_limit`` steps, so an update stays cheap and its state
    small. ``run_dir=None`` keeps everything in memory (no alarms.jsonl). ``print_fn`` receives
    each alarm name's first announcement (default: ``print``).
    """

    def __init__(
        self,
        config: HealthConfig,
        run_dir: str | os.PathLike[str] | None,
        *,
        print_fn: Callable[[str], Any] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.print_fn = print_fn if print_fn is not None else print
        keys = [k for rule in RULES.values() for k in rule.keys]
        self._keys = frozenset(k for k in keys if "*" not in k)
        self._patterns = tuple(k for k in keys if "*" in k)
        self._history: list[dict[str, float]] = []
        self._tallies: dict[str, AlarmTally] = {}
        self._printed: set[str] = set()
        self._stop = False
        self._n_steps = 0  # steps monitored (the history itself is capped)

    @property
    def history(self) -> list[dict[str, float]]:
        """The metric history the rules see."""
        return self._history

    @property
    def should_stop(self) -> bool:
        """True once an alarm whose action is ``stop`` has fired."""
        return self._stop

    def _params(self, name: str) -> AlarmConfig:
        params = getattr(self.config, name, None)
        return params if isinstance(params, AlarmConfig) else RULES[name].params_type()

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Alarm]:
        """Add one step's metrics, run the rules and return the alarms fired at this step.

        A step not after the last one (a rollback or a replay) first drops the history from that
        step on, so rules never see two rows for one step.
        """
        step = int(step)
        while self._history and self._history[-1]["step"] >= step:
            self._history.pop()
            self._n_steps -= 1
        self._n_steps += 1
        entry: dict[str, float] = {"step": step}
        for key in metrics:
            if key not in self._keys and not any(fnmatch.fnmatchcase(key, pat) for pat in self._patterns):
                continue
            v = metrics[key]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                entry[key] = float(v)
        self._history.append(entry)
        head = self.config.history_head
        if len(self._history) > head + self.config.history_limit:
            del self._history[head]  # drop the oldest step after the head

        fired = []
        for name, rule in RULES.items():
            params = self._params(name)
            if params.action != "off":
                alarm = rule.fn(self._history, params)
                if alarm is not None:
                    fired.append(alarm)
        if fired and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / ALARMS_FILE, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(a.to_dict()) + "\n" for a in fired)
        for alarm in fired:
            _add(self._tallies, alarm)
            self._stop = self._stop or alarm.severity == "stop"
            if alarm.name not in self._printed:
                self._printed.add(alarm.name)
                stop = " Training will stop." if alarm.severity == "stop" else ""
                self.print_fn(
                    f"[health] step {alarm.step}: {alarm.name} ({alarm.severity}) {alarm.message}"
                    f"{stop}\n  advice: {alarm.advice}"
                )
        return fired

    def summary(self) -> str:
        """The health of the run so far, in plain words."""
        return summarize_alarms(self._tallies, n_steps=self._n_steps)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, so a resumed run keeps its history and printed alarms."""
        return {
            "history": [dict(e) for e in self._history],
            "tallies": {
                name: {"first": t.first.to_dict(), "last": t.last.to_dict(), "count": t.count,
                       "stopped": t.stopped}
                for name, t in self._tallies.items()
            },
            "printed": sorted(self._printed),
            "stop": self._stop,
            "n_steps": self._n_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint's state. alarms.jsonl then loses its rows after the checkpoint's
        last step (all of them for a step-0 checkpoint, whose history is empty), as the trainer
        truncates metrics.jsonl, so a resumed run logs them once."""
        self._history = [dict(e) for e in state.get("history", [])]
        self._tallies = {
            name: AlarmTally(
                Alarm.from_dict(t["first"]), Alarm.from_dict(t["last"]), int(t["count"]),
                bool(t["stopped"]),
            )
            for name, t in state.get("tallies", {}).items()
        }
        self._printed = set(state.get("printed", []))
        self._stop = bool(state.get("stop", False))
        self._n_steps = int(state.get("n_steps", len(self._history)))
        self._truncate_log_after(self._history[-1]["step"] if self._history else 0)

    def _truncate_log_after(self, step: int) -> None:
        if self.run_dir is not None:
            truncate_jsonl(self.run_dir / ALARMS_FILE, step)
