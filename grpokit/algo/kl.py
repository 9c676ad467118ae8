"""Per-token KL estimators between the policy π_θ and the reference π_ref.

Source: J. Schulman, "Approximating KL Divergence", blog post, 2020. With x ~ π_θ and
u = π_ref(x)/π_θ(x) (so log u = ref_logp − logp):

    k1 = −log u = logp − ref_logp
    k2 = ½ (log u)²
    k3 = u − 1 − log u                      (GRPO, DeepSeekMath Eq. 4)
    k3_is = (π_θ/π_old) · k3                (k3 with an importance ratio, DeepSeek-V3.2 style)

Gradient when used *as a loss* (Liu et al. 2025, arXiv 2510.01555; Tang & Munos 2025, arXiv
2506.09477; derivation and worked numbers in docs/algorithms.md, "KL estimators"):
    k1 → 0 in expectation (useless as a loss; use it in the reward, see ``kl_in_reward``);
    k2 → ∇ KL(π_θ‖π_ref), the reverse-KL gradient (on-policy);
    k3 → ∇ KL(π_ref‖π_θ), the *forward* KL: a first-order approximation of the k2 gradient;
    k3_is → ρ·(logp − ref_logp)·∇logp, whose expectation under π_old is the reverse-KL gradient,
            also off-policy; its value is an unbiased estimate of KL(π_θ‖π_ref).

Numerics contract (all kinds):
- NaN anywhere in the inputs, or +inf (a log-probability cannot be +inf), raises ValueError.
- −inf log-probs are floored to the dtype's lowest finite value; the log-ratio logp − ref_logp
  (and, for k3_is, logp − old_logp) is clamped to [−clamp, clamp] before anything else, so every
  value is finite (k1 ∈ [−clamp, clamp], k2 ≤ clamp²/2, k3 ≤ e^clamp, k3_is ≤ e^(2·clamp)) and the
  gradient is 0 where the clamp is active. In a dtype too narrow for e^(2·clamp) (float16) the clamp
  is lowered to ½·log(max) − ½ so the values stay finite there too. verl clamps only k3 (log u to ±20, then the value to ±10); we clamp all
  kinds the same way and do not clamp the value.
"""

from __future__ import annotations

import math

from typing import Callable

import torch

from grpokit._names import lookup, register
from torch import Tensor

__all__ = ["KINDS", "estimate", "kl_in_reward", "register_kind"]

# fn(logp, ref_logp, *, clamp, old_logp) -> per-token values, same shape; inputs already checked.
KINDS: dict[str, Callable[..., Tensor]] = {}


def register_kind(name: str, fn=None, *, overwrite: bool = False):
    """Register ``fn(logp, ref_logp, *, clamp, old_logp=None) -> Tensor`` (also a decorator)."""
    return register(KINDS, name, fn, what="KL kind", overwrite=overwrite)


def _lookup(name: str):
    return lookup(KINDS, name, "KL kind")


def check_logp(x: Tensor, name: str, mask: Tensor | None = None) -> Tensor:
    """Raise on NaN or +inf (at ``mask`` positions if given); floor −inf to the lowest finite."""
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    bad = torch.isnan(x) | (x == float("inf"))
    if mask is not None:
        bad = bad & mask
    if bad.any():
        what = "NaN" if torch.isnan(x[bad]).any() else "+inf"
        raise ValueError(f"{name} contains {what} at {int(bad.sum())} position(s)")
    return x.clamp(min=torch.finfo(x.dtype).min)


def _log_ratio(a: Tensor, b: Tensor, clamp: float) -> Tensor:  # clamp(a − b), same shape
    return (a - b).clamp(-clamp, clamp)


@register_kind("k1")
def k1(logp: Tensor, ref_logp: Tensor, *, clamp: float, old_logp: Tensor | None = None) -> Tensor:
    """logp − ref_logp. Unbiased value, zero expected gradient as a loss."""
    return _log_ratio(logp, ref_logp, clamp)


@register_kind("k2")
def k2(logp: Tensor, ref_logp: Tensor, *, clamp: float, old_logp: Tensor | None = None) -> Tensor:
    """½(logp − ref_logp)². Biased value (E = f-divergence), reverse-KL gradient as a loss."""
    return 0.5 * _log_ratio(logp, ref_logp, clamp) ** 2


@register_kind("k3")
def k3(logp: Tensor, ref_logp: Tensor, *, clamp: float, old_logp: Tensor | None = None) -> Tensor:
    """u − 1 − log u, log u = ref − logp clamped (GRPO Eq. 4). Forward-KL gradient as a loss."""
    log_u = _log_ratio(ref_logp, logp, clamp)
    return torch.expm1(log_u) - log_u


@register_kind("k3_is")
def k3_is(
    logp: Tensor, ref_logp: Tensor, *, clamp: float, old_logp: Tensor | None = None
) -> Tensor:
    """ρ·k3 with ρ = exp(clamp(logp − sg(old_logp))) (DeepSeek-V3.2 "unbiased KL", TRL
    ``use_bias_correction_kl``). ∇ = ρ(k3 + 1 − u)∇logp = ρ(logp − ref_logp)∇logp: the reverse-KL
    gradient in expectation over x ~ π_old. With old_logp = sg(logp) its gradient is that of k2.
    """
    if old_logp is None:
        raise ValueError("KL kind 'k3_is' needs old_logp (behaviour-policy log-probs)")
    rho = torch.exp(_log_ratio(logp, old_logp.detach(), clamp))
    return rho * k3(logp, ref_logp, clamp=clamp)


def estimate(
    logp: Tensor,
    ref_logp: Tensor,
    kind: str,
    *,
    clamp: float = 20.0,
    old_logp: Tensor | None = None,
) -> Tensor:
    """Per-token KL estimate of KL(π_θ‖π_ref), same shape as ``logp`` (e.g. [B, T]).

    ``old_logp`` is used by ``k3_is`` only (ignored by the others). Masking and aggregation are
    the caller's: use ``grpokit.algo.loss.aggregate`` for "KL in loss" so it is normalised exactly
    like the policy loss.
    """
    fn = _lookup(kind)
    if not clamp > 0:
        raise ValueError(f"clamp must be > 0, got {clamp!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    logp = check_logp(logp, "logp")
    ref_logp = check_logp(ref_logp.detach(), "ref_logp")
    if old_logp is not None:
        if old_logp.shape != logp.shape:
            raise ValueError(
                f"old_logp {tuple(old_logp.shape)} and logp {tuple(logp.shape)} differ"
            )
        old_logp = check_logp(old_logp.detach(), "old_logp")
    # k3_is can reach e^(2·clamp): keep that finite in narrow dtypes (float16: clamp 5.0; no-op for
    # float32/64 and bfloat16, whose range holds e^40)
    clamp = min(clamp, 0.5 * math.log(torch.finfo(logp.dtype).max) - 0.5)
    return fn(logp, ref_logp, clamp=clamp, old_logp=old_logp)


@torch.no_grad()
def kl_in_reward(logp: Tensor, ref_logp: Tensor, mask: Tensor, *, clamp: float = 20.0) -> Tensor:
    """Per-sequence Σ_t k1 over valid tokens, detached: [B, T] -> [B].

    "KL in reward" (Ziegler et al. 2019; RLOO; REINFORCE++): r_i ← r_i − β·kl_in_reward(...)_i,
    then advantages as usual. ``logp`` is the sampling policy's (π_old) or the current policy's
    log-probs; being a reward, it carries no gradient. Through the policy-gradient route this gives
    the reverse-KL (score-function) gradient (Liu et al. 2025, arXiv 2510.01555). Only valid
    positions are checked for NaN, so padding may hold anything.
    """
    if not (logp.shape == ref_logp.shape == mask.shape) or logp.dim() != 2:
        raise ValueError(
            f"logp, ref_logp, mask must share a [B, T] shape, got {tuple(logp.shape)}, "
            f"{tuple(ref_logp.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()  # [B, T]
    logp = check_logp(logp, "logp", m)
    ref_logp = check_logp(ref_logp, "ref_logp", m)
    per_token = torch.where(m, k1(logp, ref_logp, clamp=clamp), 0.0)  # [B, T]
    return per_token.sum(-1)  # [B]
