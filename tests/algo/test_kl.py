"""Tests for grpokit.algo.kl: the worked values of docs/algorithms.md §7.2 and gradients, expected gradients on a
categorical distribution, non-negativity, and hostile inputs."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.algo.kl import KINDS, estimate, kl_in_reward

T = torch.tensor
F64 = torch.float64


def value_and_grad(kind, logp=-1.0, ref=-1.5, **kw):
    x = T([logp], dtype=F64, requires_grad=True)
    v = estimate(x, T([ref], dtype=F64), kind, **kw)
    v.sum().backward()
    return v.item(), x.grad.item()


@pytest.mark.parametrize(
    "kind, value, grad",
    [
        # docs/algorithms.md §7.2: log π_θ = −1, log π_ref = −1.5, log u = −0.5, u = 0.6065307
        ("k1", 0.5, 1.0),  # logp − ref
        ("k2", 0.125, 0.5),  # ½·0.5², d/dlogp = 0.5
        ("k3", 0.1065307, 0.3934693),  # e^{−0.5} + 0.5 − 1, d/dlogp = 1 − u
    ],
)
def test_single_token_golden(kind, value, grad):
    v, g = value_and_grad(kind)
    assert v == pytest.approx(value, abs=1e-7)
    assert g == pytest.approx(grad, abs=1e-7)


def test_k3_is_single_token_golden():
    # docs/algorithms.md §7.2: k3·ρ with ρ ≡ 1 (old = sg(logp)): value k3 = 0.1065307, gradient
    # ρ(k3 + 1 − u) = 0.1065307 + 0.3934693 = 0.5 (= −log u, the k2 gradient).
    v, g = value_and_grad("k3_is", old_logp=T([-1.0], dtype=F64))
    assert v == pytest.approx(0.1065307, abs=1e-7)
    assert g == pytest.approx(0.5, abs=1e-7)
    # Off-policy, old_logp = −1.2: ρ = e^{0.2} = 1.2214028; value ρ·k3 = 0.1301170;
    # gradient ρ·(logp − ref) = 1.2214028·0.5 = 0.6107014.
    v, g = value_and_grad("k3_is", old_logp=T([-1.2], dtype=F64))
    assert v == pytest.approx(1.2214028 * 0.1065307, abs=1e-7)
    assert g == pytest.approx(0.6107014, abs=1e-7)


def test_k3_is_needs_old_logp():
    with pytest.raises(ValueError, match="k3_is.*old_logp"):
        estimate(T([-1.0]), T([-1.5]), "k3_is")


# docs/algorithms.md §7.2 categorical check: π_θ = softmax(0,0,0), π_ref = [0.5, 0.3, 0.2]
REVERSE_KL_GRAD = [-0.158568, 0.011707, 0.146862]  # ∇_logits KL(π_θ‖π_ref)
FORWARD_KL_GRAD = [-0.166667, 0.033333, 0.133333]  # ∇_logits KL(π_ref‖π_θ)


def expected_grad(kind):
    """Σ_x π_θ(x) ∇_logits estimator(x): exact expectation over the 3 categories."""
    ref_logp = torch.log(T([0.5, 0.3, 0.2], dtype=F64))
    total = torch.zeros(3, dtype=F64)
    for x in range(3):
        logits = torch.zeros(3, dtype=F64, requires_grad=True)
        logp = torch.log_softmax(logits, -1)[x : x + 1]
        kw = {"old_logp": logp.detach()} if kind == "k3_is" else {}
        (grad,) = torch.autograd.grad(estimate(logp, ref_logp[x : x + 1], kind, **kw).sum(), logits)
        total += math.exp(logp.item()) * grad
    return total


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [0.0, 0.0, 0.0]),  # E[∇ log π] = 0: useless as a loss
        ("k2", REVERSE_KL_GRAD),  # k2 as loss = reverse-KL gradient
        ("k3", FORWARD_KL_GRAD),  # k3 as loss = forward-KL gradient (GRPO's bias)
        ("k3_is", REVERSE_KL_GRAD),  # k3·ρ on-policy = reverse-KL gradient
    ],
)
def test_categorical_expected_gradient(kind, expected):
    torch.testing.assert_close(expected_grad(kind), T(expected, dtype=F64), atol=1e-6, rtol=0)


def test_reference_gradients_are_what_they_claim():
    # Independent check of the two reference vectors by autograd through the exact KLs.
    logits = torch.zeros(3, dtype=F64, requires_grad=True)
    p, ref = torch.softmax(logits, -1), T([0.5, 0.3, 0.2], dtype=F64)
    (g_rev,) = torch.autograd.grad((p * (p.log() - ref.log())).sum(), logits)
    torch.testing.assert_close(g_rev, T(REVERSE_KL_GRAD, dtype=F64), atol=1e-6, rtol=0)
    p = torch.softmax(logits, -1)
    (g_fwd,) = torch.autograd.grad((ref * (ref.log() - p.log())).sum(), logits)
    torch.testing.assert_close(g_fwd, T(FORWARD_KL_GRAD, dtype=F64), atol=1e-6, rtol=0)


def test_categorical_expected_values():
    # docs/algorithms.md §7.2: E[k1] = E[k3] = KL(π_θ‖π_ref) = 0.0702403; E[k2] = 0.0727409
    p = torch.full((3,), 1 / 3, dtype=F64)
    logp, ref = p.log(), torch.log(T([0.5, 0.3, 0.2], dtype=F64))
    expect = {"k1": 0.0702403, "k3": 0.0702403, "k2": 0.0727409}
    for kind, value in expect.items():
        assert (p * estimate(logp, ref, kind)).sum().item() == pytest.approx(value, abs=1e-7)


logps = st.floats(-50.0, 0.0, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(logps, logps), min_size=1, max_size=8))
def test_k2_k3_nonnegative_and_k3_is_with_rho1_equals_k3(pairs):
    logp = T([a for a, _ in pairs], dtype=F64)
    ref = T([b for _, b in pairs], dtype=F64)
    assert (estimate(logp, ref, "k2") >= 0).all()
    k3 = estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    torch.testing.assert_close(estimate(logp, ref, "k3_is", old_logp=logp), k3)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_hostile_finite_extremes(kind):
    # −1e4 log-probs (a token the model finds impossible): log-ratio clamped to ±20 -> finite
    # values and gradients. k1 = clamp(−1e4 − (−1)) = −20; k3 with log u = +20: e^{20} − 21.
    logp = T([-1e4, -1.0, -1e4, float("-inf")], dtype=F64, requires_grad=True)
    ref = T([-1.0, -1e4, -1e4, -1.0], dtype=F64)
    v = estimate(logp, ref, kind, old_logp=logp.detach())
    v.sum().backward()
    assert torch.isfinite(v).all() and torch.isfinite(logp.grad).all()
    if kind == "k1":
        torch.testing.assert_close(v, T([-20.0, 20.0, 0.0, -20.0], dtype=F64))
    if kind == "k3":
        assert v[0].item() == pytest.approx(math.exp(20) - 21)
        assert v[1].item() == pytest.approx(math.exp(-20) - 1 + 20)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("bad, match", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
def test_hostile_nan_and_pos_inf_raise(kind, bad, match):
    good = T([-1.0, -2.0])
    hostile = T([-1.0, bad])
    with pytest.raises(ValueError, match=f"logp contains {match}"):
        estimate(hostile, good, kind, old_logp=good)
    with pytest.raises(ValueError, match=f"ref_logp contains {match}"):
        estimate(good, hostile, kind, old_logp=good)


def test_bad_arguments():
    with pytest.raises(ValueError, match="did you mean 'k3'"):
        estimate(T([-1.0]), T([-1.0]), "k_3")
    with pytest.raises(ValueError, match="differ"):
        estimate(T([-1.0]), T([-1.0, -2.0]), "k1")
    with pytest.raises(ValueError, match="clamp"):
        estimate(T([-1.0]), T([-1.0]), "k1", clamp=0.0)


def test_kl_in_reward_golden_and_detached():
    # docs/algorithms.md §7.2: per-token k1 = [0.2, −0.1, 0.3] -> Σ = 0.4; with β = 0.1 and r = 1, the
    # sequence reward becomes 1 − 0.1·0.4 = 0.96. The second row is padded after 1 token and the
    # padding holds NaN, which must be ignored.
    logp = T([[-1.0, -2.0, -0.5], [-1.0, float("nan"), float("nan")]], requires_grad=True)
    ref = T([[-1.2, -1.9, -0.8], [-1.5, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    kl_seq = kl_in_reward(logp, ref, mask)
    torch.testing.assert_close(kl_seq, T([0.4, 0.5]))
    assert not kl_seq.requires_grad
    assert 1.0 - 0.1 * kl_seq[0].item() == pytest.approx(0.96)
    with pytest.raises(ValueError, match="NaN"):
        kl_in_reward(logp, ref, T([[1, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        kl_in_reward(logp[0], ref[0], mask[0])


def test_import_does_not_pull_transformers():
    code = "import sys, grpokit.algo; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(logps, logps), min_size=1, max_size=8))
def test_k1_is_the_log_ratio_and_antisymmetric(pairs):
    logp = T([a for a, _ in pairs], dtype=F64)
    ref = T([b for _, b in pairs], dtype=F64)
    torch.testing.assert_close(estimate(logp, ref, "k1"), (logp - ref).clamp(-20, 20), atol=0, rtol=0)
    torch.testing.assert_close(estimate(ref, logp, "k1"), -estimate(logp, ref, "k1"), atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_float16_values_stay_finite(kind):
    logp = T([[-30.0, 0.0, -1.0]], dtype=torch.float16)
    ref = T([[0.0, -30.0, -1.5]], dtype=torch.float16)
    v = estimate(logp, ref, kind, old_logp=logp - 10)
    assert v.dtype == torch.float16 and torch.isfinite(v).all()
