"""Clipped policy-gradient surrogate and loss aggregation.

Per token (PPO, Schulman et al. 2017, arXiv 1707.06347, Eq. 7, written as a loss to minimise):

    ρ = exp(clamp(logp − old_logp, ±log_ratio_clamp))                          # [B, T]
    l = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))                           # [B, T]

- ε_high > ε_low is DAPO's Clip-Higher (Yu et al. 2025, arXiv 2503.14476 §3.1).
- ``dual_clip=c`` (c > 1, Ye et al. arXiv 1912.09729; verl ``compute_policy_loss_vanilla``):
  l = where(A < 0, min(−A·c, l), l), so a negative-advantage token with ρ > c has bounded loss.
- ``ratio_level="sequence"``: GSPO (arXiv 2507.18071, Eq. 7 and the GSPO-token form Eqs. 13-14):
  s_i = exp(mean_t log ρ_{i,t}) and ρ_{i,t} = sg(s_i)·π_θ/sg(π_θ), equal to s_i in value, so
  per-token advantages work. Each token's log-ratio is clamped before the mean.

Aggregations (``AGGREGATIONS``; worked example in docs/algorithms.md, "Worked examples"), with l
masked to the valid tokens:

    token_mean               Σ l / N_tokens                DAPO Eq. 12; TRL dapo; verl token-mean
    seq_mean_token_mean      (1/N_seqs) Σ_i Σ_t l / |o_i|  GRPO Eq. 3; TRL grpo
    seq_mean_token_sum_norm  Σ l / (N_seqs · max_len)      Dr. GRPO Listing 1; TRL dr_grpo

Micro-batch contract: cut a batch along B into micro-batches and pass each call the *whole*
batch's ``num_tokens`` (token_mean: number of valid tokens) or ``num_seqs`` (seq_* modes: number of
rows B) and the same ``max_len``. Then the micro-batch losses sum to the whole-batch loss (exactly
up to float rounding), so accumulating their gradients (without dividing by the number of
micro-batches) gives the whole-batch gradient. Left as None, they default to the counts of the
tensors passed in. Under data parallelism with gradient *averaging* over R ranks, pass the global
counts and multiply the loss by R (verl's ``* dp_size``), or sum-reduce the gradients instead.
"""

from __future__ import annotations

import math

from typing import Callable

import torch

from grpokit._names import lookup, register
from torch import Tensor

from grpokit.algo.kl import check_logp
from grpokit.algo.kl import estimate as estimate_kl

__all__ = [
    "AGGREGATIONS", "aggregate", "clipped_surrogate", "grpo_loss", "policy_loss", "register_aggregation",
    "truncated_is_weights",
]

# fn(masked_loss [B, T] (0 at invalid), mask [B, T] bool, *, num_tokens, num_seqs, max_len) -> []
AGGREGATIONS: dict[str, Callable[..., Tensor]] = {}


def register_aggregation(name: str, fn=None, *, overwrite: bool = False):
    """Register ``fn(masked_loss, mask, *, num_tokens, num_seqs, max_len) -> scalar``."""
    return register(AGGREGATIONS, name, fn, what="aggregation", overwrite=overwrite)


def _lookup(name: str):
    return lookup(AGGREGATIONS, name, "aggregation")


def _count(value, default: Tensor, name: str):
    """A caller-given count (int, float or 0-d tensor) or the local default; never below 1."""
    if value is None:
        return default.clamp(min=1)
    if isinstance(value, Tensor):
        if value.numel() != 1 or not bool(torch.isfinite(value).all() and (value >= 0).all()):
            raise ValueError(f"{name} must be one finite number >= 0, got {value!r}")
        return value.to(default.dtype).clamp(min=1)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return max(float(value), 1.0)


@register_aggregation("token_mean")
def token_mean(masked_loss: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None):
    """Σ l / N_tokens (all valid tokens of the batch weigh the same). DAPO Eq. 12."""
    n = _count(num_tokens, mask.sum().to(masked_loss.dtype), "num_tokens")
    return masked_loss.sum() / n


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(
    masked_loss: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None
):
    """(1/N_seqs) Σ_i (Σ_t l_{i,t} / |o_i|). GRPO Eq. 3. Rows with no valid token add 0 but count
    in N_seqs (default B), as in TRL ``loss_type="grpo"``."""
    per_seq = masked_loss.sum(-1) / mask.sum(-1).clamp(min=1).to(masked_loss.dtype)  # [B]
    n = _count(num_seqs, masked_loss.new_tensor(float(mask.shape[0])), "num_seqs")
    return per_seq.sum() / n


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    masked_loss: Tensor, mask: Tensor, *, num_tokens=None, num_seqs=None, max_len=None
):
    """Σ l / (N_seqs · max_len). Dr. GRPO Listing 1 (max_len = the generation budget). verl's mode
    of the same name omits the 1/N_seqs (docs/algorithms.md, "Where grpokit differs")."""
    if max_len is None or not max_len > 0:
        raise ValueError(
            f"aggregation 'seq_mean_token_sum_norm' needs max_len > 0, got {max_len!r}"
        )
    n = _count(num_seqs, masked_loss.new_tensor(float(mask.shape[0])), "num_seqs")
    return masked_loss.sum() / (n * float(max_len))


def aggregate(
    per_token_loss: Tensor,
    mask: Tensor,
    agg: str = "token_mean",
    *,
    num_tokens=None,
    num_seqs=None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar with the named aggregation (module docstring).

    Positions where ``mask`` is false are replaced by 0 (they may hold anything finite or not in
    the forward pass; keep their *gradients* finite). Valid positions must be finite.
    """
    fn = _lookup(agg)
    if per_token_loss.dim() != 2 or per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss and mask must share a [B, T] shape, got "
            f"{tuple(per_token_loss.shape)} and {tuple(mask.shape)}"
        )
    m = mask.bool()
    masked = torch.where(m, per_token_loss, 0.0)  # [B, T]
    if not torch.isfinite(masked.detach()).all():  # only valid positions can be non-finite here
        raise ValueError("per_token_loss holds NaN or inf at valid (mask = 1) positions")
    return fn(masked, m, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> Tensor:
    """Per-token loss max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) (+ dual clip). All [B, T]."""
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(-advantages * dual_clip, loss), loss)
    return loss


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    max_len: int | None = None,
    ratio_level: str = "token",
    num_tokens=None,
    num_seqs=None,
    log_ratio_clamp: float = 20.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and its statistics.

    ``is_weights`` [B, T] (constants, e.g. `truncated_is_weights`) multiply the per-token loss
    before aggregation: the correction for a sampler whose numerics differ from the trainer's.

    Shapes: logp, old_logp, mask [B, T]; advantages [B] or [B, T]. ``old_logp`` and
    ``advantages`` are treated as constants. NaN or +inf at a valid position raises ValueError;
    invalid positions may hold anything. An empty mask gives loss 0 with the graph intact.

    Stats (python floats over the valid tokens of this call): clip_frac_low (A < 0 and
    ρ < 1 − ε_low), clip_frac_high (A > 0 and ρ > 1 + ε_high) — the tokens whose gradient the clip
    zeroes; dual_clip_frac (A < 0 and −A·c below the clipped loss, also zero gradient) when
    ``dual_clip`` is set; approx_kl = mean of k3 for KL(π_old‖π_θ) = ρ − 1 − log ρ with the token
    ratio; ratio_min / ratio_mean / ratio_max of the ratio used (the sequence ratio under GSPO).
    With no valid token the fractions and approx_kl are 0 and the ratio stats 1.
    """
    if logp.dim() != 2 or not (logp.shape == old_logp.shape == mask.shape):
        raise ValueError(
            f"logp, old_logp, mask must share a [B, T] shape, got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    if not log_ratio_clamp > 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp!r}")

    m = mask.bool()  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Invalid positions are replaced by 0 so garbage there never reaches the loss or its gradient.
    logp = torch.where(m, check_logp(logp, "logp", m), zero)  # [B, T]
    old_logp = torch.where(m, check_logp(old_logp.detach(), "old_logp", m), zero)  # [B, T]
    adv = advantages.detach().to(logp.dtype)
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand_as(logp)  # [B, T]
    if torch.isnan(adv[m]).any() or torch.isinf(adv[m]).any():
        raise ValueError("advantages contain NaN or inf at valid positions")
    adv = torch.where(m, adv, zero)

    log_ratio = (logp - old_logp).clamp(-log_ratio_clamp, log_ratio_clamp)  # [B, T]
    if ratio_level == "sequence":
        n_tok = m.sum(-1).clamp(min=1).to(logp.dtype)  # [B]
        seq_log_ratio = (log_ratio * m).sum(-1) / n_tok  # [B]
        log_rho = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # [B, T], GSPO-token
    else:
        log_rho = log_ratio
    ratio = torch.exp(log_rho)  # [B, T]

    per_token = clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip)  # [B, T]
    if is_weights is not None:
        if is_weights.shape != logp.shape:
            raise ValueError(f"is_weights must be [B, T] = {tuple(logp.shape)}, got {tuple(is_weights.shape)}")
        per_token = per_token * torch.where(m, is_weights.detach().to(logp.dtype), zero)
    loss = aggregate(
        per_token, m, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
    )

    with torch.no_grad():
        n = m.sum().clamp(min=1).to(logp.dtype)
        frac = lambda cond: (cond & m).sum().to(logp.dtype) / n  # noqa: E731
        r = ratio.detach()
        values = {
            "clip_frac_low": frac((adv < 0) & (r < 1.0 - eps_low)),
            "clip_frac_high": frac((adv > 0) & (r > 1.0 + eps_high)),
            "approx_kl": (torch.where(m, torch.expm1(log_ratio) - log_ratio, zero)).sum() / n,
            "ratio_min": torch.where(m, r, torch.full_like(r, float("inf"))).amin() if m.any() else zero + 1,
            "ratio_mean": torch.where(m, r, zero).sum() / n,
            "ratio_max": torch.where(m, r, torch.full_like(r, float("-inf"))).amax() if m.any() else zero + 1,
            "token_sum": torch.where(m, per_token.detach(), zero).sum(),
        }
        if dual_clip is not None:
            clipped = torch.maximum(-adv * r, -adv * r.clamp(1.0 - eps_low, 1.0 + eps_high))
            values["dual_clip_frac"] = frac((adv < 0) & (-adv * dual_clip < clipped))
        stats = dict(zip(values, torch.stack(list(values.values())).tolist()))
        if not m.any():
            stats.update(ratio_mean=1.0)
    return loss, stats


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    kl_kind: str = "k3",
    agg: str = "token_mean",
    num_tokens=None,
    num_seqs=None,
    max_len: int | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss of one micro-batch: clipped surrogate + β · KL(π_θ‖π_ref), both aggregated alike.

    DeepSeekMath (Shao et al. 2024) Eq. 3 with the aggregation named by ``agg``; ``num_tokens`` /
    ``num_seqs`` are the counts of the *whole* (mini-)batch, over all micro-batches and ranks, so
    the micro-batch losses sum to the batch loss (module docstring). A data-parallel worker only
    has to pass the global counts. Shapes: logp, old_logp, ref_logp, mask, is_weights [B, T];
    advantages [B] or [B, T].

    Stats (floats): policy (the surrogate term), token_sum (Σ surrogate over valid tokens), the
    policy_loss ratio/clip statistics, and with a KL term kl (the aggregated KL term) and kl_sum
    (Σ per-token KL over valid tokens), n_tokens (valid tokens of this micro-batch).
    """
    pg, stats = policy_loss(
        logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
        agg=agg, max_len=max_len, ratio_level=ratio_level, num_tokens=num_tokens, num_seqs=num_seqs,
        is_weights=is_weights,
    )
    stats = {"policy": float(pg.detach()), **stats, "n_tokens": float(mask.bool().sum())}
    total = pg
    if ref_logp is not None and beta > 0:
        m = mask.bool()
        kl_tok = estimate_kl(logp, ref_logp, kl_kind, old_logp=old_logp)  # [B, T]
        kl_term = aggregate(kl_tok, m, agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
        total = total + beta * kl_term
        stats["kl"] = float(kl_term.detach())
        stats["kl_sum"] = float(torch.where(m, kl_tok.detach(), 0.0).sum())
    return total, stats


@torch.no_grad()
def truncated_is_weights(
    trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, *, cap: float = 2.0
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling for a sampler whose numerics differ from the trainer's.

    w_t = min(exp(log π_old(o_t) − log μ(o_t)), C)                             # [B, T]

    with π_old the trainer's log-probs of the sampled tokens before the update and μ the
    sampler's (e.g. an inference engine's). The policy gradient is an expectation under π_old but
    the tokens were drawn from μ; w_t reweights them, truncated at C to bound the variance (Yao et
    al. 2025, "Your efficient RL framework secretly brings you off-policy RL training": TIS; TRL's
    ``vllm_importance_sampling_correction``, verl's ``tis_imp_ratio_cap``). Zero at invalid
    positions. Stats: logprob_diff_mean / logprob_diff_max (|log π_old − log μ| over valid tokens),
    is_clip_frac (share of valid tokens whose weight was truncated), is_weight_mean.
    """
    if not (trainer_logp.shape == sampler_logp.shape == mask.shape):
        raise ValueError(
            f"trainer_logp, sampler_logp, mask must share a shape, got {tuple(trainer_logp.shape)}, "
            f"{tuple(sampler_logp.shape)}, {tuple(mask.shape)}"
        )
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be finite and > 0, got {cap!r}")
    m = mask.bool()
    a = check_logp(trainer_logp, "trainer_logp", m)
    b = check_logp(sampler_logp, "sampler_logp", m)
    diff = torch.where(m, a - b, 0.0)  # [B, T]
    raw = torch.exp(diff.clamp(max=math.log(cap) + 1.0))  # only whether it exceeds cap matters above it
    w = torch.where(m, raw.clamp(max=cap), 0.0)
    n = max(int(m.sum()), 1)
    stats = {
        "logprob_diff_mean": float(diff.abs().sum()) / n,
        "logprob_diff_max": float(diff.abs().max()) if m.any() else 0.0,
        "is_clip_frac": float(((raw > cap) & m).sum()) / n,
        "is_weight_mean": float(w.sum()) / n if m.any() else 1.0,
    }
    return w, stats
