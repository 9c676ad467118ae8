"""Non-finite guard: name the likely cause of a NaN/inf update, in the diagnosis order of the
practitioner's rule "NaN diagnosis order" (docs/training.md, "Practitioner's rules"), extended.

The order goes from the cheapest, most common culprit to the rarest: rewards that could not be
computed, a group whose rewards are all equal (only a problem for estimators that divide by the
group std without care: grpokit's give 0), an importance ratio that overflowed, extreme or non-finite
log-probs (a probability underflowing to 0), and finally the logits / gradients themselves.

grpokit gives a sample whose reward is NaN/inf, and every sample of a zero-std group, advantage 0,
so those two can only cause a NaN through the advantages. When the advantages are finite they are
reported after the cause as context ("also: ..."), since they are still worth knowing about.
"""

from __future__ import annotations

import math

import torch


class NonFiniteStep(RuntimeError):
    """Raised inside an update when a loss or log-prob is not finite; the update is skipped."""


def diagnose(*, rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
             frac_zero_std: float | None = None, ratio_max: float | None = None,
             logp_min: float | None = None, logp_finite: bool = True, grad_finite: bool = True,
             half_precision: str | None = None) -> str:
    """Return a one-line cause for a skipped update: the first check in the order that applies.

    `rewards`: the step's rewards (NaN = could not be scored); `frac_zero_std`: the share of its
    groups whose rewards are all equal. Both lead the order but are the cause only when the
    `advantages` are not finite; otherwise they are appended as context. `half_precision`: the
    dtype name ("bfloat16", "float16") when the step ran in it and a float32 recomputation of the
    same forward pass was finite (the third check of the diagnosis order, docs/training.md)."""
    n_bad = int((~torch.isfinite(rewards)).sum()) if rewards is not None else 0
    bad_rewards = f"{n_bad} reward(s) not finite (a reward function failed or returned NaN/inf)" if n_bad else None
    has_zero_std = frac_zero_std is not None and math.isfinite(frac_zero_std) and frac_zero_std > 0
    zero_std = f"{frac_zero_std:.0%} of groups have zero std" if has_zero_std else None
    if advantages is not None and not torch.isfinite(advantages).all():
        return bad_rewards or "non-finite advantages" + (f" ({zero_std})" if zero_std else "")
    cause = _update_cause(ratio_max, logp_min, logp_finite, grad_finite, half_precision)
    context = [c for c in (bad_rewards, zero_std) if c]
    return cause + (f"; also: {'; '.join(context)} (given advantage 0)" if context else "")


def _update_cause(ratio_max: float | None, logp_min: float | None, logp_finite: bool, grad_finite: bool,
                  half_precision: str | None = None) -> str:
    """The rest of the order, for an update whose advantages are finite."""
    if ratio_max is not None and (not math.isfinite(ratio_max) or ratio_max > 1e3):
        return f"importance ratio overflow (max ratio {ratio_max:.3g})"
    precision = (f"mixed precision: the forward pass overflowed in {half_precision} but its float32 "
                 "recomputation is finite (train in float32, or keep the logits and loss in float32)")
    if not logp_finite:
        return precision if half_precision else "non-finite log-probs (NaN/inf logits in the forward pass)"
    if logp_min is not None and logp_min < -1e3:
        return f"extreme log-probs (min {logp_min:.3g}): a sampled token had ~0 probability under the policy"
    if half_precision:
        return precision
    if not grad_finite:
        return "non-finite gradients (overflow in backward)"
    return "non-finite loss (cause not identified)"


class ReferenceDriftError(RuntimeError):
    """The frozen reference's log-probs on the probe batch moved (raised with `guard.ref_strict`)."""


class Guard:
    """Counts what the non-finite guard kept from the weights and decides when to roll back.

    A NaN in one mini-batch skips only that mini-batch's update: the others are sound and are
    applied. So the counts are kept apart: `guard/skipped_minibatches` counts every skipped
    update, `guard/skipped_steps` only the steps none of whose updates was applied. A step with
    any skipped update is *bad* all the same: it counts toward the rollback (a NaN tends to come
    back) and the next checkpoint is not marked healthy."""

    def __init__(self, max_consecutive_bad: int):
        self.max_consecutive_bad = max_consecutive_bad
        self.skipped_steps = 0
        self.skipped_minibatches = 0
        self.rollbacks = 0
        self.consecutive_bad = 0
        self.bad_since_save = False

    def after_step(self, skipped: int, updates: int) -> bool:
        """Record a step with `skipped` of its `updates` updates skipped; True when it is time to
        roll back."""
        if not skipped:
            self.consecutive_bad = 0
            return False
        self.skipped_minibatches += skipped
        if skipped >= updates:
            self.skipped_steps += 1
        self.consecutive_bad += 1
        self.bad_since_save = True
        return self.consecutive_bad >= self.max_consecutive_bad

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.consecutive_bad = 0
        self.bad_since_save = False          # the weights are the healthy checkpoint's again

    def metrics(self) -> dict[str, float]:
        return {"guard/skipped_steps": float(self.skipped_steps),
                "guard/skipped_minibatches": float(self.skipped_minibatches),
                "guard/rollbacks": float(self.rollbacks)}

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "skipped_minibatches": self.skipped_minibatches,
                "rollbacks": self.rollbacks}

    def load_state_dict(self, s: dict) -> None:
        self.skipped_steps = s.get("skipped_steps", 0)
        self.skipped_minibatches = s.get("skipped_minibatches", self.skipped_steps)
        self.rollbacks = s.get("rollbacks", 0)
