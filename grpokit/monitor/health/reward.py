"""Rules on the reward signal: `no_signal` (groups whose rewards are all equal, so advantages
carry no signal), `reward_hacking` (training reward rising while held-out accuracy does not, or
answer checkers disagreeing) and `rewards_missing` (most of a step's completions without a reward).
"""

from __future__ import annotations

import statistics

from pydantic import Field, model_validator

from grpokit.monitor.health.base import Alarm, AlarmConfig, History, _num, _slope, _step, _tail, builtin_rule


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



class RewardsMissingConfig(AlarmConfig):
    max_missing: float = Field(0.5, gt=0.0, le=1.0)
    """Fire when at least this fraction of a step's completions has no reward
    (`reward/total_nan_frac`: a reward returned None, raised or timed out)."""



@builtin_rule(
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


@builtin_rule(
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



@builtin_rule("rewards_missing", RewardsMissingConfig, keys=("reward/total_nan_frac", "reward/*/none_frac"))
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

