"""Tests for grpokit.algo.loss: clipped surrogate tables (docs/algorithms.md §7.3), aggregation
table (§3.5), micro-batch x accumulation invariance, clip-gradient properties, hostile inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.algo.kl import estimate
from grpokit.algo.loss import AGGREGATIONS, aggregate, policy_loss
from grpokit.algo import kl as kl_mod
from grpokit.algo import loss as loss_mod

T = torch.tensor
F64 = torch.float64


def one_token(adv, rho, **kw):
    """Loss, d loss / d logp and stats for a single token with ratio rho (old_logp = −1)."""
    old = T([[-1.0]], dtype=F64)
    logp = (old + math.log(rho)).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, T([adv], dtype=F64), mask, **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


# docs/algorithms.md §7.3: per-token clipped loss. Unclipped gradient d(−Aρ)/dlogp = −Aρ.
@pytest.mark.parametrize(
    "adv, rho, eps_high, loss, grad, clipped",
    [
        (1.0, 1.25, 0.2, -1.2, 0.0, "high"),  # symmetric: clipped at 1.2, no gradient
        (1.0, 1.25, 0.28, -1.25, -1.25, None),  # DAPO clip-higher: not clipped
        (1.0, 1.5, 0.28, -1.28, 0.0, "high"),  # DAPO: clipped at 1.28
        (-1.0, 0.5, 0.2, 0.8, 0.0, "low"),  # clipped at 1 − 0.2
        (-1.0, 0.5, 0.28, 0.8, 0.0, "low"),
        (-1.0, 1.5, 0.2, 1.5, 1.5, None),  # pessimistic branch, gradient flows
        (-1.0, 1.5, 0.28, 1.5, 1.5, None),
    ],
)
def test_clipped_loss_table(adv, rho, eps_high, loss, grad, clipped):
    value, g, stats = one_token(adv, rho, eps_low=0.2, eps_high=eps_high)
    assert value == pytest.approx(loss, abs=1e-9)
    assert g == pytest.approx(grad, abs=1e-9)
    assert stats["clip_frac_high"] == (1.0 if clipped == "high" else 0.0)
    assert stats["clip_frac_low"] == (1.0 if clipped == "low" else 0.0)
    assert stats["ratio_mean"] == pytest.approx(rho)


# docs/algorithms.md §7.3 dual clip, ε = 0.2, c = 3.
@pytest.mark.parametrize(
    "adv, rho, dual, loss, grad, frac",
    [
        (-1.0, 5.0, None, 5.0, 5.0, None),  # standard PPO: loss −Aρ = 5, gradient 5
        (-1.0, 5.0, 3.0, 3.0, 0.0, 1.0),  # dual clip: min(−A·c, 5) = 3, constant
        (-1.0, 1.5, 3.0, 1.5, 1.5, 0.0),  # below c: unchanged
        (1.0, 5.0, 3.0, -1.2, 0.0, 0.0),  # A > 0: unaffected (ordinary clip)
    ],
)
def test_dual_clip_table(adv, rho, dual, loss, grad, frac):
    value, g, stats = one_token(adv, rho, dual_clip=dual)
    assert value == pytest.approx(loss, abs=1e-9)
    assert g == pytest.approx(grad, abs=1e-9)
    assert stats.get("dual_clip_frac") == frac


def test_gspo_sequence_ratio():
    # docs/algorithms.md §7.3: token log-ratios [0.1, −0.2, 0.4] -> s = exp(mean) = e^{0.1} = 1.1051709.
    # Clip (1 − 3e-4, 1 + 4e-4): with A = +1 s clips to 1.0004, the whole sequence gets no gradient.
    old = T([[-1.0, -2.0, -3.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    kw = dict(eps_low=3e-4, eps_high=4e-4, ratio_level="sequence", agg="seq_mean_token_mean")

    logp = (old + T([[0.1, -0.2, 0.4]], dtype=F64)).requires_grad_(True)
    loss, stats = policy_loss(logp, old, T([1.0], dtype=F64), mask, **kw)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0004)
    assert torch.equal(logp.grad, torch.zeros(1, 3, dtype=F64))
    assert stats["ratio_mean"] == pytest.approx(1.1051709) and stats["clip_frac_high"] == 1.0
    # token-level ratios would have been [1.105171, 0.818731, 1.491825]
    assert policy_loss(logp, old, T([1.0], dtype=F64), mask, **{**kw, "ratio_level": "token"})[1][
        "ratio_max"
    ] == pytest.approx(1.491825, abs=1e-6)

    # A = −1: unclipped branch, loss = s = 1.1051709;
    # GSPO gradient d s / d logp_t = s/|y| = 0.368390
    logp = (old + T([[0.1, -0.2, 0.4]], dtype=F64)).requires_grad_(True)
    loss, _ = policy_loss(logp, old, T([-1.0], dtype=F64), mask, **kw)
    loss.backward()
    assert loss.item() == pytest.approx(1.1051709)
    torch.testing.assert_close(logp.grad, torch.full((1, 3), 1.1051709 / 3, dtype=F64))

    # GSPO-token with per-token advantages all equal to A gives the same loss and gradient.
    logp2 = logp.detach().clone().requires_grad_(True)
    loss2, _ = policy_loss(logp2, old, T([[-1.0, -1.0, -1.0]], dtype=F64), mask, **kw)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item())
    torch.testing.assert_close(logp2.grad, logp.grad)


def test_gspo_token_per_token_advantages():
    # GSPO-token (Eqs. 13-14): ρ_t = sg(s)·π_θ/sg(π_θ), so token t's gradient is −A_t·s/|y| (its own
    # advantage), not the sequence average. s = e^{0.1} = 1.1051709 lies inside [0.8, 1.2]: no clip.
    # A = [1, −1, 2]: loss = −s·(1 − 1 + 2)/3 = −0.736781; grad = [−0.368390, 0.368390, −0.736781]
    old = T([[-1.0, -2.0, -3.0]], dtype=F64)
    logp = (old + T([[0.1, -0.2, 0.4]], dtype=F64)).requires_grad_(True)
    loss, _ = policy_loss(logp, old, T([[1.0, -1.0, 2.0]], dtype=F64), torch.ones(1, 3),
                          ratio_level="sequence", agg="seq_mean_token_mean")
    loss.backward()
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(-2 * s / 3)
    torch.testing.assert_close(logp.grad, T([[-s / 3, s / 3, -2 * s / 3]], dtype=F64))


# docs/algorithms.md §7.3: A = [+1, −1], lengths [2, 4], L_max = 4, ρ = 1 so l_{i,t} = −A_i.
# The gradient of the loss w.r.t. logp_{i,t} is −A_i · (per-token weight).
AGG_TABLE = [
    # GRPO ½[(−2)/2 + 4/4] = 0; weights 1/(G|o_i|) = 1/4, 1/8
    ("seq_mean_token_mean", 0.0, [[-0.25, -0.25, 0, 0], [0.125] * 4]),
    # DAPO 2/6; weight 1/6
    ("token_mean", 1 / 3, [[-1 / 6, -1 / 6, 0, 0], [1 / 6] * 4]),
    # Dr. GRPO 2/(2·4); weight 1/8
    ("seq_mean_token_sum_norm", 0.25, [[-0.125, -0.125, 0, 0], [0.125] * 4]),
]


@pytest.mark.parametrize("agg, value, grad", AGG_TABLE)
def test_aggregation_table(agg, value, grad):
    old = torch.full((2, 4), -1.0, dtype=F64)
    logp = old.clone().requires_grad_(True)
    mask = T([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    loss, _ = policy_loss(logp, old, T([1.0, -1.0], dtype=F64), mask, agg=agg, max_len=4)
    loss.backward()
    assert loss.item() == pytest.approx(value, abs=1e-12)
    torch.testing.assert_close(logp.grad, T(grad, dtype=F64))


def test_grpo_single_token_objective_with_kl():
    # docs/algorithms.md §7.3: Â = 0.866025, logp = old = −1 (ρ = 1), ref = −1.5, β = 0.04:
    # k3 = 0.1065307, objective = 0.866025 − 0.04·0.1065307 = 0.8617638 -> loss −0.8617638
    logp = T([[-1.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    adv = T([0.866025], dtype=F64)
    pg, _ = policy_loss(logp, logp.detach(), adv, mask, agg="seq_mean_token_mean")
    kl_term = aggregate(estimate(logp, T([[-1.5]], dtype=F64), "k3"), mask, "seq_mean_token_mean")
    assert (pg + 0.04 * kl_term).item() == pytest.approx(-0.8617638, abs=1e-7)


def test_approx_kl_and_ratio_stats():
    # valid log-ratios [0.1, −0.2] (third token masked): k3 of KL(old‖new) = ρ − 1 − log ρ
    # = [e^{0.1} − 1.1, e^{−0.2} − 0.8] = [0.0051709, 0.0187308] -> mean 0.0119508
    old = T([[-1.0, -1.0, -1.0]], dtype=F64)
    logp = old + T([[0.1, -0.2, 3.0]], dtype=F64)
    _, stats = policy_loss(logp, old, T([1.0], dtype=F64), T([[1, 1, 0]]))
    assert stats["approx_kl"] == pytest.approx(0.0119508, abs=1e-7)
    assert stats["ratio_min"] == pytest.approx(math.exp(-0.2))
    assert stats["ratio_max"] == pytest.approx(math.exp(0.1))
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.2)) / 2)
    assert all(isinstance(v, float) for v in stats.values())


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    adv=st.floats(1e-3, 10.0),
    excess=st.floats(1e-4, 5.0),
    eps_low=st.floats(0.0, 0.9),
    eps_high=st.floats(0.0, 1.0),
    positive=st.booleans(),
)
def test_clip_zeroes_gradient_exactly(adv, excess, eps_low, eps_high, positive):
    # A > 0 and ρ > 1 + ε_high, or A < 0 and ρ < 1 − ε_low: the gradient is exactly 0.
    if positive:
        rho, a = (1 + eps_high) * math.exp(excess), adv
    else:
        rho, a = (1 - eps_low) * math.exp(-excess), -adv
    _, g, stats = one_token(a, rho, eps_low=eps_low, eps_high=eps_high)
    assert g == 0.0
    assert stats["clip_frac_high" if positive else "clip_frac_low"] == 1.0


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]))
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=F64) * 0.3
    adv_shape = (b,) if draw(st.booleans()) else (b, t)
    adv = torch.randn(*adv_shape, generator=g, dtype=F64)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, b - 1)), max_size=3)))) if b > 1 else []
    return logp, old, adv, mask, cuts


def split(x, cuts):
    bounds = [0, *cuts, x.shape[0]]
    return [x[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=80, deadline=None)
@given(
    batches(),
    st.sampled_from(sorted(AGGREGATIONS)),
    st.sampled_from(["token", "sequence"]),
    st.sampled_from([None, 3.0]),
)
def test_microbatch_accumulation_invariance(batch, agg, ratio_level, dual_clip):
    logp, old, adv, mask, cuts = batch
    b, t = logp.shape
    kw = dict(agg=agg, max_len=t + 2, ratio_level=ratio_level, dual_clip=dual_clip, eps_high=0.28)

    whole = logp.clone().requires_grad_(True)
    loss_whole, _ = policy_loss(whole, old, adv, mask, **kw)
    loss_whole.backward()

    parts = logp.clone().requires_grad_(True)
    total = 0.0
    for lp, o, a, m in zip(*(split(x, cuts) for x in (parts, old, adv, mask))):
        loss, _ = policy_loss(lp, o, a, m, num_tokens=int(mask.sum()), num_seqs=b, **kw)
        loss.backward()  # gradients accumulate into `parts.grad`
        total += loss.item()

    assert total == pytest.approx(loss_whole.item(), abs=1e-6)
    torch.testing.assert_close(parts.grad, whole.grad, atol=1e-6, rtol=0)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(sorted(AGGREGATIONS)))
def test_aggregate_invariance_and_tensor_counts(batch, agg):
    # aggregate() alone (e.g. the KL term), with counts given as tensors.
    values, _, _, mask, cuts = batch
    values = values.requires_grad_(True)
    whole = aggregate(values, mask, agg, max_len=7)
    n_tok, n_seq = mask.sum(), torch.tensor(mask.shape[0])
    parts = [aggregate(v, m, agg, num_tokens=n_tok, num_seqs=n_seq, max_len=7)
             for v, m in zip(split(values, cuts), split(mask, cuts))]
    total = torch.stack(parts).sum()
    assert total.item() == pytest.approx(whole.item(), abs=1e-9)
    (g_whole,) = torch.autograd.grad(whole, values)
    (g_parts,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(g_parts, g_whole, atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------------
# Hostile inputs and bad arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_empty_mask_gives_zero_loss_with_graph(agg, ratio_level):
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach() - 0.5, T([1.0, -1.0]), torch.zeros(2, 3),
                              agg=agg, max_len=3, ratio_level=ratio_level)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))
    assert stats["clip_frac_low"] == 0.0 and stats["approx_kl"] == 0.0
    assert stats["ratio_mean"] == 1.0
    assert all(math.isfinite(v) for v in stats.values())


def test_empty_micro_batch_with_global_counts():
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), T([1.0]), torch.zeros(1, 3), num_tokens=12)
    assert loss.item() == 0.0


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_hostile_logps(ratio_level):
    # Valid tokens at −1e4 and −inf (old or new) give finite loss and gradient (log-ratio clamped
    # to ±20); garbage (NaN, +inf) at masked positions is ignored.
    nan, inf = float("nan"), float("inf")
    logp = T([[-1e4, -1.0, nan], [-inf, -2.0, inf]], requires_grad=True)
    old = T([[-1.0, -1e4, inf], [-1.0, -inf, nan]])
    mask = T([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    loss, stats = policy_loss(logp, old, T([1.0, -1.0]), mask, ratio_level=ratio_level)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in stats.values())
    assert logp.grad[:, 2].abs().sum() == 0


@pytest.mark.parametrize(
    "which, value, match",
    [
        ("logp", float("nan"), "logp contains NaN"),
        ("logp", float("inf"), r"logp contains \+inf"),
        ("old", float("nan"), "old_logp contains NaN"),
        ("adv", float("nan"), "advantages contain NaN"),
        ("adv", float("inf"), "advantages contain"),
    ],
)
def test_hostile_nonfinite_at_valid_positions_raise(which, value, match):
    logp, old, adv = torch.full((2, 2), -1.0), torch.full((2, 2), -1.0), T([1.0, -1.0])
    {"logp": logp, "old": old, "adv": adv}[which][1] = value
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, old, adv, torch.ones(2, 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(agg="token_men"), "did you mean 'token_mean'"),
        (dict(agg="seq_mean_token_sum_norm"), "max_len"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(ratio_level="seq"), "ratio_level"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
        (dict(num_tokens=-1), "num_tokens"),
    ],
)
def test_bad_arguments(kwargs, match):
    logp = torch.full((2, 2), -1.0)
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, logp, T([1.0, -1.0]), torch.ones(2, 2), **kwargs)


def test_bad_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(x, torch.zeros(2, 4), T([1.0, 1.0]), x)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, T([1.0, 1.0, 1.0]), x)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(torch.zeros(3), torch.zeros(3), "token_mean")


def test_an_empty_batch_gives_zero_loss_and_neutral_stats():
    z = torch.zeros((0, 5), dtype=torch.float64, requires_grad=True)
    loss, st = policy_loss(z, z.detach(), torch.zeros(0, dtype=torch.float64), torch.zeros((0, 5), dtype=torch.bool))
    assert loss.item() == 0.0 and st["ratio_min"] == st["ratio_max"] == st["ratio_mean"] == 1.0
    loss.backward()


@pytest.mark.parametrize("count", [torch.tensor(float("nan")), torch.tensor(-3.0), torch.tensor([1.0, 2.0]),
                                   float("nan"), float("inf"), -1])
def test_bad_token_counts_are_refused_as_numbers_and_as_tensors(count):
    lp = torch.zeros((2, 3), dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(lp, lp.detach(), torch.ones(2, dtype=torch.float64), torch.ones((2, 3)), num_tokens=count)


def test_aggregate_refuses_non_finite_values_at_valid_positions():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    assert aggregate(x, torch.tensor([[1, 0], [0, 1]])).item() == 1.5          # garbage at masked positions is fine
    with pytest.raises(ValueError, match="NaN or inf"):
        aggregate(x, torch.ones((2, 2)))


def test_truncated_is_weights_hand_worked():
    # log pi_old - log mu per token: [0.5, -1.0, 2.0 | pad], cap C = 2
    #   w = min(e^0.5, 2) = 1.6487213, min(e^-1, 2) = 0.3678794, min(e^2 = 7.389, 2) = 2 (truncated)
    #   |diff| mean = (0.5 + 1 + 2) / 3 = 1.1666667, max 2; clipped 1 of 3; mean weight 4.0166007 / 3
    old = torch.tensor([[-1.0, -2.0, -0.5, 9.0]], dtype=torch.float64)
    mu = torch.tensor([[-1.5, -1.0, -2.5, float("nan")]], dtype=torch.float64)   # pad may hold anything
    mask = torch.tensor([[1, 1, 1, 0]])
    w, st = loss_mod.truncated_is_weights(old, mu, mask, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.6487213, 0.3678794, 2.0, 0.0], abs=1e-7)
    assert st["logprob_diff_mean"] == pytest.approx(3.5 / 3)
    assert st["logprob_diff_max"] == pytest.approx(2.0)
    assert st["is_clip_frac"] == pytest.approx(1 / 3)
    assert st["is_weight_mean"] == pytest.approx((1.6487213 + 0.3678794 + 2.0) / 3, abs=1e-7)
    # same numerics on both sides: every weight is exactly 1, nothing clipped
    w1, st1 = loss_mod.truncated_is_weights(old, old, mask)
    assert torch.equal(w1, mask.to(w1.dtype)) and st1["is_clip_frac"] == 0.0
    with pytest.raises(ValueError, match="cap"):
        loss_mod.truncated_is_weights(old, mu, mask, cap=float("inf"))


def test_is_weights_scale_the_per_token_surrogate_hand_worked():
    # ratio 1 (logp = old), A = [1, -2], token_mean over 3 valid tokens; per-token loss = -A
    #   row 0: tokens (w 0.5, w 2.0) -> -1*0.5 + -1*2.0 = -2.5; row 1: one token, w 1.5 -> 2*1.5 = 3
    #   loss = (-2.5 + 3.0) / 3 = 0.1666667; without weights (-1 - 1 + 2) / 3 = 0
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    w = torch.tensor([[0.5, 2.0], [1.5, 0.0]], dtype=torch.float64)
    loss, st = loss_mod.grpo_loss(logp, logp.detach(), adv, mask, is_weights=w)
    assert float(loss) == pytest.approx(0.5 / 3)
    assert float(loss_mod.grpo_loss(logp, logp.detach(), adv, mask)[0]) == pytest.approx(0.0)
    loss.backward()                       # d/dlogp of -A*w*exp(logp-old) at ratio 1 = -A*w / 3
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5 / 3, -2.0 / 3, 3.0 / 3, 0.0])


def test_grpo_loss_is_surrogate_plus_beta_kl_with_global_counts():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        whole, st = loss_mod.grpo_loss(logp, old, adv, mask, ref_logp=ref, beta=0.3, kl_kind="k3", agg=agg, max_len=5)
        pg, _ = loss_mod.policy_loss(logp, old, adv, mask, agg=agg, max_len=5)
        kl = loss_mod.aggregate(kl_mod.estimate(logp, ref, "k3"), mask, agg, max_len=5)
        assert float(whole) == pytest.approx(float(pg + 0.3 * kl), abs=1e-12)
        # two micro-batches with the whole batch's counts sum to the whole loss
        parts = sum(float(loss_mod.grpo_loss(logp[s], old[s], adv[s], mask[s], ref_logp=ref[s], beta=0.3, agg=agg,
                                             max_len=5, num_tokens=int(mask.sum()), num_seqs=4)[0])
                    for s in (slice(0, 1), slice(1, 4)))
        assert parts == pytest.approx(float(whole), abs=1e-12)
        assert st["kl_sum"] == pytest.approx(float(torch.where(mask.bool(), kl_mod.estimate(logp, ref, "k3"), 0.0).sum()))
