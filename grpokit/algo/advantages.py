"""Group-relative advantage estimators: one scalar advantage per completion.

All estimators share one signature and live in ``ESTIMATORS``; ``compute`` is the only entry point
the trainer needs. Rewards are a flat vector laid out group after group (``group_size``), or carry
explicit ``group_ids`` (variable group sizes, e.g. after filtering).

Conventions shared by every estimator (docs/algorithms.md, "Advantage estimators"):
- std is Bessel-corrected (÷(n−1)), eps is added outside the square root: (r − mean)/(std + eps).
- A cell (group, or group × length bucket) whose finite rewards are all equal, or that has fewer
  than two finite rewards, gives advantage exactly 0. verl instead gives a singleton group its raw
  reward (mean 0, std 1); we follow TRL's GRPOTrainer.
- Non-finite rewards mean "could not be scored": they are left out of every statistic and their
  advantage is 0. ``stats["num_nonfinite"]`` counts them.
- Statistics are computed in float64; the result has the dtype of ``rewards``.
"""

from __future__ import annotations

import math
import numbers

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpokit._names import lookup, register
from torch import Tensor

__all__ = [
    "Cells",
    "ESTIMATORS",
    "Estimator",
    "compute",
    "quantile_edges",
    "register_estimator",
]

# fn(rewards [N] float64 with 0 where invalid, cells, *, eps, lengths [N] float64 | None) -> [N]
Estimator = Callable[..., Tensor]
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, fn: Estimator | None = None, *, overwrite: bool = False):
    """Register ``fn(rewards, cells, *, eps, lengths) -> advantages [N]`` under ``name``.

    Usable as ``register_estimator("x", fn)`` or as a decorator ``@register_estimator("x")``.
    """
    return register(ESTIMATORS, name, fn, what="advantage estimator", overwrite=overwrite)


def _lookup(name: str) -> Estimator:
    return lookup(ESTIMATORS, name, "advantage estimator")


# ----------------------------------------------------------------------------------------------
# Cells: the sets of completions that share a baseline.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cells:
    """A partition of N completions into ``num`` cells; statistics use valid members only.

    ``index`` [N] long in [0, num); ``valid`` [N] bool (reward is finite). Every per-cell reduction
    is returned broadcast back to the completions, shape [N]. Where ``use_fallback`` [N] is true,
    the reductions come from the ``fallback`` partition instead (a length bucket with fewer than
    two valid rewards uses its whole group).
    """

    index: Tensor
    num: int
    valid: Tensor
    fallback: "Cells | None" = None
    use_fallback: Tensor | None = None

    def _pick(self, own: Tensor, method: str, *args) -> Tensor:
        if self.fallback is None:
            return own
        return torch.where(self.use_fallback, getattr(self.fallback, method)(*args), own)

    def _reduce_sum(self, x: Tensor) -> Tensor:  # [N] -> [num]
        out = torch.zeros(self.num, dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.index, torch.where(self.valid, x, torch.zeros_like(x)))

    def count(self) -> Tensor:  # [N] number of valid members of each completion's cell
        own = self._reduce_sum(self.valid.to(torch.float64))[self.index]
        return self._pick(own, "count")

    def mean(self, x: Tensor, weights: Tensor | None = None) -> Tensor:  # [N]
        """Cell mean of x; with ``weights``, Σ w·x / Σ w (plain mean where Σ w = 0)."""
        n = self._reduce_sum(self.valid.to(x.dtype))
        plain = self._reduce_sum(x) / n.clamp(min=1)
        own = plain
        if weights is not None:
            w_sum = self._reduce_sum(weights)
            weighted = self._reduce_sum(weights * x) / torch.where(w_sum > 0, w_sum, 1.0)
            own = torch.where(w_sum > 0, weighted, plain)
        return self._pick(own[self.index], "mean", x, weights)

    def std(self, x: Tensor) -> Tensor:  # [N] Bessel std; 0 where the cell has < 2 valid members
        n = self._reduce_sum(self.valid.to(x.dtype))
        mean = (self._reduce_sum(x) / n.clamp(min=1))[self.index]
        var = self._reduce_sum((x - mean) ** 2) / (n - 1).clamp(min=1)
        return self._pick(var.sqrt()[self.index], "std", x)

    def cell_constant(self, x: Tensor) -> Tensor:  # [num] bool: < 2 valid, or all valid equal
        xv, iv = x[self.valid], self.index[self.valid]
        lo = torch.full((self.num,), float("inf"), dtype=x.dtype, device=x.device)
        hi = torch.full((self.num,), float("-inf"), dtype=x.dtype, device=x.device)
        lo = lo.scatter_reduce(0, iv, xv, "amin", include_self=True)
        hi = hi.scatter_reduce(0, iv, xv, "amax", include_self=True)
        n = self._reduce_sum(self.valid.to(x.dtype))
        return (n < 2) | (lo == hi)

    def constant(self, x: Tensor) -> Tensor:  # [N] bool
        return self._pick(self.cell_constant(x)[self.index], "constant", x)


def _batch_std(x: Tensor, valid: Tensor) -> Tensor:
    """Bessel std of x over the valid entries of the whole batch (0 if fewer than 2). Scalar."""
    n = valid.sum()
    if n < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    xv = x[valid]
    return xv.std(correction=1)


def _centred(r: Tensor, cells: Cells) -> Tensor:  # [N] r − cell mean, exactly 0 in constant cells
    return torch.where(cells.constant(r), torch.zeros_like(r), r - cells.mean(r))


def _over(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where den is 0 (a batch std of 0 with eps = 0: every num is then 0 too)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


# ----------------------------------------------------------------------------------------------
# Estimators. Signature: (r [N] float64, cells, *, eps, lengths) -> [N]; invalid entries of r are
# 0 and are zeroed again by ``compute``.
# ----------------------------------------------------------------------------------------------


@register_estimator("grpo")
def grpo(r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None) -> Tensor:
    """(r − mean_g) / (std_g + eps), std with Bessel. DeepSeekMath (Shao et al. 2024,
    arXiv 2402.03300) §4.1.2."""
    adv = (r - cells.mean(r)) / (cells.std(r) + eps)
    return torch.where(cells.constant(r), torch.zeros_like(r), adv)


@register_estimator("dr_grpo")
def dr_grpo(r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None) -> Tensor:
    """r − mean_g, no std. Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) §3.2."""
    return _centred(r, cells)


@register_estimator("rloo")
def rloo(r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None) -> Tensor:
    """r − mean of the other n−1 rewards = n/(n−1)·(r − mean_g). RLOO (Ahmadian et al. 2024,
    arXiv 2402.14740; Kool et al. 2019).

    Uses the identity form; a cell with one valid member gives 0 (verl leaves the raw score).
    """
    n = cells.count()
    return _centred(r, cells) * n / (n - 1).clamp(min=1)


@register_estimator("sign")
def sign(r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None) -> Tensor:
    """sign of the grpo advantage, in {−1, 0, +1}. No paper proposes it (the nearest:
    Zhu et al. 2025, arXiv 2506.01347, on learning from the sign of correctness); an ablation.

    A reward that equals its cell mean up to float64 rounding (|r − mean| ≤ 1e-12·max(|r|, |mean|),
    a tolerance of each completion's own magnitude, so one group's large rewards never blur another
    group's small differences) gets 0: the middle of [0.1, 0.2, 0.3] is 0, not a rounding-noise ±1.
    """
    centred = _centred(r, cells)
    scale = torch.maximum(r.abs(), (r - centred).abs())       # [N] |r| and |cell mean|
    centred = torch.where(centred.abs() <= 1e-12 * scale, torch.zeros_like(centred), centred)
    return torch.sign(centred)


@register_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(
    r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None
) -> Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262; OpenRLHF ``reinforce_baseline``):
    A' = r − mean_g, then A = A' / (std_batch(A') + eps).

    Deviations: std_batch is the Bessel std over completions (OpenRLHF: biased variance over tokens,
    rsqrt(clamp(var, 1e-8))); eps is added outside the sqrt; A' is not re-centred (ms-swift form),
    since its batch mean is already 0 without buckets and this keeps all-equal groups at exactly 0.
    """
    centred = _centred(r, cells)
    return _over(centred, _batch_std(centred, cells.valid) + eps)


@register_estimator("batch_std")
def batch_std(r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None) -> Tensor:
    """(r − mean_g) / (std_batch(r) + eps), std of the raw rewards over the batch (Bessel).

    Lite PPO (arXiv 2508.08221); TRL ``scale_rewards="batch"`` (which uses eps = 1e-4).
    """
    return _over(_centred(r, cells), _batch_std(r, cells.valid) + eps)


@register_estimator("opo")
def opo(r: Tensor, cells: Cells, *, eps: float, lengths: Tensor | None = None) -> Tensor:
    """r − b with the length-weighted baseline b = Σ|o_i| r_i / Σ|o_i| (OPO, arXiv 2505.23585).

    Matches verl ``compute_opo_outcome_advantage``; no std. Falls back to the plain mean in a cell
    whose total length is 0.
    """
    if lengths is None:
        raise ValueError("advantage estimator 'opo' needs lengths (completion token counts)")
    adv = r - cells.mean(r, weights=lengths)
    return torch.where(cells.constant(r), torch.zeros_like(r), adv)


# ----------------------------------------------------------------------------------------------
# Length buckets
# ----------------------------------------------------------------------------------------------


def _group_index(n: int, group_size, group_ids, device) -> tuple[Tensor, int]:
    """-> (index [N] long in [0, K), K)."""
    if (group_size is None) == (group_ids is None):
        raise ValueError("give exactly one of group_size or group_ids")
    if group_ids is not None:
        ids = torch.as_tensor(group_ids, device=device)
        if ids.dim() != 1 or ids.numel() != n:
            raise ValueError(f"group_ids must have shape [{n}], got {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor, got {ids.dtype}")
        uniq, index = torch.unique(ids, return_inverse=True)
        return index, int(uniq.numel())
    if isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool):
        group_size = int(group_size)                        # numpy / torch integers too
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if n % group_size:
        raise ValueError(f"number of rewards {n} is not divisible by group_size {group_size}")
    return torch.arange(n, device=device) // group_size, n // group_size


def quantile_edges(lengths, groups, q: Sequence[float]) -> Tensor:
    """Per-completion bucket edges at the quantiles ``q`` of its own group's lengths.

    groups: an int group size or a LongTensor [N] of group ids. Returns float64 [N, len(q)], row i
    holding the edges of completion i's group (linear interpolation, as ``torch.quantile``). Pass
    the result as ``buckets`` to ``compute`` (or use ``bucket_mode="quantiles"``). E.g. a group
    with lengths [100, 200, 300, 400] and q=[0.5] gets edge 250: buckets {100, 200} and {300, 400}.
    """
    lengths = torch.as_tensor(lengths).to(torch.float64).flatten()
    qs = torch.as_tensor(list(q), dtype=torch.float64, device=lengths.device)
    if qs.numel() == 0 or (qs < 0).any() or (qs > 1).any() or (qs.diff() < 0).any():
        raise ValueError(f"quantiles must be a non-empty ascending list in [0, 1], got {list(q)}")
    size, ids = (groups, None) if isinstance(groups, int) else (None, groups)
    index, k = _group_index(lengths.numel(), size, ids, lengths.device)
    # Sort by (group, length) so each group is a contiguous sorted run starting at start[g].
    by_len = torch.argsort(lengths, stable=True)
    order = by_len[torch.argsort(index[by_len], stable=True)]
    sorted_len = lengths[order]  # [N]
    n = torch.bincount(index, minlength=k)  # [K]
    start = torch.cumsum(n, 0) - n  # [K]
    pos = qs[None, :] * (n[:, None] - 1).clamp(min=0)  # [K, E]
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n[:, None] - 1).clamp(min=0))
    a, b = sorted_len[start[:, None] + lo], sorted_len[start[:, None] + hi]
    edges = a + (pos - lo) * (b - a)  # [K, E]
    return edges[index]  # [N, E]


def _bucket_cells(groups: Cells, lengths: Tensor | None, buckets, mode: str) -> tuple[Cells, int]:
    """Cells = group × length bucket; members of a bucket with < 2 valid rewards use their group.

    Returns (cells, number of completions that fell back to their whole group).
    """
    if lengths is None:
        raise ValueError("buckets need lengths (completion token counts)")
    if mode == "quantiles":
        edges = quantile_edges(lengths, groups.index, buckets)
    elif mode == "tokens":
        edges = torch.as_tensor(buckets, dtype=torch.float64, device=lengths.device)
    else:
        raise ValueError(f"bucket_mode must be 'tokens' or 'quantiles', got {mode!r}")
    if edges.dim() == 1:
        edges = edges.expand(lengths.numel(), -1)
    if edges.dim() != 2 or edges.shape[0] != lengths.numel():
        raise ValueError(f"bucket edges must be [E] or [N, E], got {tuple(edges.shape)}")
    if not torch.isfinite(edges).all() or (edges.diff(dim=-1) < 0).any():
        raise ValueError("bucket edges must be finite and ascending")
    # Bucket k holds lengths in [edge_{k-1}, edge_k): a length equal to an edge goes up.
    bucket = torch.searchsorted(edges.contiguous(), lengths[:, None], right=True)[:, 0]  # [N]
    nb = edges.shape[1] + 1
    own = Cells(groups.index * nb + bucket, groups.num * nb, groups.valid)
    small = own.count() < 2  # [N]
    cells = Cells(own.index, own.num, own.valid, fallback=groups, use_fallback=small)
    return cells, int(small.sum())


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def compute(
    estimator: str,
    rewards: Tensor,
    group_size: int | None = None,
    *,
    eps: float = 1e-6,
    lengths: Tensor | None = None,
    buckets=None,
    group_ids: Tensor | None = None,
    return_stats: bool = False,
    bucket_mode: str = "tokens",
):
    """Advantages [N] for flat rewards [N] (group after group, or tagged with ``group_ids``).

    estimator: a name in ``ESTIMATORS`` (grpo, dr_grpo, rloo, sign, reinforce_pp_baseline,
        batch_std, opo).
    lengths: [N] completion token counts; needed by ``opo`` and by ``buckets``.
    buckets: length-bucket edges. ``bucket_mode="tokens"``: edges in tokens, a list [E] shared by
        all groups or a tensor [N, E] per completion (see ``quantile_edges``);
        ``bucket_mode="quantiles"``: quantiles in [0, 1] of each group's lengths. The group
        baseline (and std) of a completion is then taken over its group ∩ its bucket; a bucket with
        fewer than 2 finite rewards falls back to the whole group. Batch-level statistics
        (reinforce_pp_baseline, batch_std) are unaffected.
    Returns advantages [N] (dtype of rewards), and with ``return_stats`` also a dict of python
        numbers: num_groups, num_nonfinite, num_bucket_fallback (ints); frac_zero_std (groups whose
        finite rewards are all equal or fewer than 2), adv_mean, adv_std, reward_mean, reward_std
        (floats over the finite-reward completions; std with Bessel).
    """
    fn = _lookup(estimator)
    r = torch.as_tensor(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be a flat [N] tensor, got shape {tuple(r.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    out_dtype = r.dtype if r.is_floating_point() else torch.get_default_dtype()
    n = r.numel()
    group_index, num_groups = _group_index(n, group_size, group_ids, r.device)
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=r.device).to(torch.float64)
        if lengths.shape != r.shape:
            raise ValueError(f"lengths must have shape [{n}], got {tuple(lengths.shape)}")
        if not torch.isfinite(lengths).all() or (lengths < 0).any():
            raise ValueError("lengths must be finite and >= 0")

    valid = torch.isfinite(r)  # [N]
    r64 = torch.where(valid, r.to(torch.float64), 0.0)  # [N]
    groups = Cells(group_index, num_groups, valid)
    cells, num_fallback = groups, 0
    if buckets is not None:
        cells, num_fallback = _bucket_cells(groups, lengths, buckets, bucket_mode)

    adv = fn(r64, cells, eps=float(eps), lengths=lengths)  # [N]
    adv = torch.where(valid, adv, torch.zeros_like(adv)).to(out_dtype)
    if not return_stats:
        return adv

    with torch.no_grad():
        a, rv = adv.to(torch.float64)[valid], r64[valid]
        zero_std = groups.cell_constant(r64).double()  # [K]
        stats = {
            "num_groups": num_groups,
            "frac_zero_std": float(zero_std.mean()) if num_groups else 0.0,
            "num_nonfinite": n - int(valid.sum()),
            "adv_mean": float(a.mean()) if a.numel() else 0.0,
            "adv_std": float(a.std()) if a.numel() > 1 else 0.0,
            "reward_mean": float(rv.mean()) if rv.numel() else 0.0,
            "reward_std": float(rv.std()) if rv.numel() > 1 else 0.0,
            "num_bucket_fallback": num_fallback,
        }
    return adv, stats
