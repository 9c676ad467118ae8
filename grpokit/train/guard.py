"""Non-finite guard: name the likely cause of a NaN/inf update, in the seed's diagnosis order.

The order goes from the cheapest, most common culprit to the rarest: rewards that could not be
computed, a group whose rewards are all equal (only a problem for estimators that divide by the
group std without care: grpokit's give 0), an importance ratio that overflowed, extreme or non-finite
log-probs (a probability underflowing to 0), and finally the logits / gradients themselves.
"""

from __future__ import annotations

import math

import torch


class NonFiniteStep(RuntimeError):
    """Raised inside an update when a loss or log-prob is not finite; the update is skipped."""


def diagnose(*, rewards: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
             frac_zero_std: float | None = None, ratio_max: float | None = None,
             logp_min: float | None = None, logp_finite: bool = True, grad_finite: bool = True) -> str:
    """Return a one-line cause for a skipped update (the first check in the order that applies)."""
    if rewards is not None and not torch.isfinite(rewards).all():
        n = int((~torch.isfinite(rewards)).sum())
        return f"{n} reward(s) not finite (a reward function failed or returned NaN/inf)"
    if advantages is not None and not torch.isfinite(advantages).all():
        zs = f" ({frac_zero_std:.0%} of groups have zero std)" if frac_zero_std else ""
        return f"non-finite advantages{zs}"
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
