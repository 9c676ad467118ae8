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
             logp_min: float | None = None, logp_finite: bool = True, grad_finite: bool = True) -> str:
    """Return a one-line cause for a skipped update: the first check in the order that applies.

    `rewards`: the step's rewards (NaN = could not be scored); `frac_zero_std`: the share of its
    groups whose rewards are all equal. Both lead the order but are the cause only when the
    `advantages` are not finite; otherwise they are appended as context."""
    n_bad = int((~torch.isfinite(rewards)).sum()) if rewards is not None else 0
    bad_rewards = f"{n_bad} reward(s) not finite (a reward function failed or returned NaN/inf)" if n_bad else None
    has_zero_std = frac_zero_std is not None and math.isfinite(frac_zero_std) and frac_zero_std > 0
    zero_std = f"{frac_zero_std:.0%} of groups have zero std" if has_zero_std else None
    if advantages is not None and not torch.isfinite(advantages).all():
        return bad_rewards or "non-finite advantages" + (f" ({zero_std})" if zero_std else "")
    cause = _update_cause(ratio_max, logp_min, logp_finite, grad_finite)
    context = [c for c in (bad_rewards, zero_std) if c]
    return cause + (f"; also: {'; '.join(context)} (given advantage 0)" if context else "")


def _update_cause(ratio_max: float | None, logp_min: float | None, logp_finite: bool, grad_finite: bool) -> str:
    """The rest of the order, for an update whose advantages are finite."""
    if ratio_max is not None and (not math.isfinite(ratio_max) or ratio_max > 1e3):
        return f"importance ratio overflow (max ratio {ratio_max:.3g})"
    if not logp_finite:
        return "non-finite log-probs (NaN/inf logits in the forward pass)"
    if logp_min is not None and logp_min < -1e3:
        return f"extreme log-probs (min {logp_min:.3g}): a sampled token had ~0 probability under the policy"
    if not grad_finite:
        return "non-finite gradients (overflow in backward)"
    return "non-finite loss (cause not identified)"


class ReferenceDriftError(RuntimeError):
    """The frozen reference's log-probs on the probe batch moved (raised with `guard.ref_strict`)."""
