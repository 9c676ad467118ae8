"""Tests for grpokit.algo.advantages: the worked examples of docs/algorithms.md §7.1, properties, hostile inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpokit.algo import advantages
from grpokit.algo.advantages import ESTIMATORS, compute, quantile_edges

T = torch.tensor
F64 = torch.float64
GROUP_BASELINE = ["grpo", "dr_grpo", "rloo", "sign", "opo", "reinforce_pp_baseline", "batch_std"]


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), T(expected, dtype=F64), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# Golden values
# ---------------------------------------------------------------------------------------------


A = T([1.0, 0, 0, 1])  # worked group "A" (docs/algorithms.md §7.1)
B = T([1.0, 1, 1, 0])  # worked group "B"
AB = torch.cat([A, B])


def test_grpo_bessel_golden():
    # docs/algorithms.md §7.1: A: mean 0.5, Bessel std 0.5773503 -> ±0.866025.
    # B: mean 0.75, Bessel std 0.5 -> [0.5, 0.5, 0.5, -1.5].
    s = 0.866025
    close(compute("grpo", AB, 4, eps=0.0), [s, -s, -s, s, 0.5, 0.5, 0.5, -1.5])
    # verl convention, eps = 1e-6: 0.5/(0.5773503 + 1e-6) = 0.8660239
    s = 0.866024
    close(compute("grpo", A, 4, eps=1e-6), [s, -s, -s, s])
    # TRL convention, eps = 1e-4: 0.5/0.5774503 = 0.865875;
    # B: 0.25/0.5001 = 0.49990, -0.75/0.5001 = -1.49970
    s = 0.865875
    close(compute("grpo", A, 4, eps=1e-4), [s, -s, -s, s])
    close(compute("grpo", B, 4, eps=1e-4), [0.49990, 0.49990, 0.49990, -1.49970], atol=1e-5)


def test_grpo_pm1_rewards_same_as_01():
    # docs/algorithms.md §7.1: DAPO's ±1 reward [1,-1,-1,1] gives the same advantages as [1,0,0,1].
    s = 0.866025
    close(compute("grpo", T([1.0, -1, -1, 1]), 4, eps=0.0), [s, -s, -s, s])


def test_dr_grpo_golden():
    # docs/algorithms.md §7.1: A -> [0.5,-0.5,-0.5,0.5]; B -> [0.25,0.25,0.25,-0.75]
    close(compute("dr_grpo", AB, 4), [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])


def test_rloo_golden():
    # docs/algorithms.md §7.1: A -> ±2/3 ; B -> [1/3, 1/3, 1/3, -1]
    # e.g. first entry: 1 - mean(0,0,1) = 1 - 1/3 = 2/3.
    close(compute("rloo", AB, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])


def test_sign_golden():
    # sign of the grpo advantages of A | B | [2,2,2,2]
    close(compute("sign", torch.cat([AB, T([2.0, 2, 2, 2])]), 4),
          [1, -1, -1, 1, 1, 1, 1, -1, 0, 0, 0, 0], atol=0)
    # In float64, 0.2 − mean(0.1, 0.2, 0.3) = −2.8e-17 and 2.2 − mean(1.1, 2.2, 3.3) = 4.4e-16:
    # rounding noise, the middle entries must still be 0.
    r = T([0.1, 0.2, 0.3, 1.1, 2.2, 3.3], dtype=F64)
    close(compute("sign", r, 3), [-1, 0, 1, -1, 0, 1], atol=0)


def test_reinforce_pp_baseline_golden():
    # docs/algorithms.md §7.1: centred A' = [.5,-.5,-.5,.5,.25,.25,.25,-.75], batch Bessel std 0.5
    # -> [1,-1,-1,1,0.5,0.5,0.5,-1.5]  (OpenRLHF's biased variance would give 1.069045 ...)
    adv = compute("reinforce_pp_baseline", AB, 4, eps=0.0)
    close(adv, [1, -1, -1, 1, 0.5, 0.5, 0.5, -1.5])


def test_batch_std_golden_trl():
    # docs/algorithms.md §7.1, TRL scale_rewards="batch": raw-reward Bessel std 0.517549, eps 1e-4
    # 0.5/0.517649 = 0.965905; 0.25/0.517649 = 0.482953; -0.75/0.517649 = -1.448858
    adv = compute("batch_std", AB, 4, eps=1e-4)
    close(adv, [0.965905, -0.965905, -0.965905, 0.965905, 0.482953, 0.482953, 0.482953, -1.448858])


def test_opo_golden():
    # docs/algorithms.md §7.1: r=[1,0,0,1], |o|=[100,300,200,100]: b = 200/700 = 0.285714
    # A = [0.714286, -0.285714, -0.285714, 0.714286]
    adv = compute("opo", T([1.0, 0, 0, 1]), 4, lengths=T([100, 300, 200, 100]))
    close(adv, [0.714286, -0.285714, -0.285714, 0.714286])


def test_opo_needs_lengths():
    with pytest.raises(ValueError, match="opo.*lengths"):
        compute("opo", T([1.0, 0, 0, 1]), 4)


def test_group_ids_variable_sizes_match_separate_calls():
    # groups of size 3 (ids 7) and 2 (ids -1), interleaved; each group alone must give the same.
    r = T([1.0, 0.0, 5.0, 2.0, 3.0])
    ids = T([7, -1, 7, -1, 7])
    adv = compute("grpo", r, group_ids=ids, eps=0.0)
    g7 = compute("grpo", T([1.0, 5.0, 3.0]), 3, eps=0.0)  # mean 3, std 2 -> [-1, 1, 0]
    g_1 = compute("grpo", T([0.0, 2.0]), 2, eps=0.0)  # mean 1, std sqrt(2) -> ∓0.707107
    close(adv, [g7[0], g_1[0], g7[1], g_1[1], g7[2]])
    close(g7, [-1.0, 1.0, 0.0])


# ---------------------------------------------------------------------------------------------
# Zero variance, singletons, non-finite rewards, stats
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GROUP_BASELINE)
def test_all_equal_group_is_exactly_zero(name):
    # 0.1 is not representable: the float mean of [0.1]*3 may differ from 0.1 by rounding; the
    # result must still be exactly 0 (not eps noise) in that group.
    r = T([0.1, 0.1, 0.1, 1.0, 0.0, 1.0], dtype=torch.float32)
    adv = compute(name, r, 3, lengths=T([3, 5, 7, 3, 5, 7]))
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all() and adv[3:].abs().sum() > 0


@pytest.mark.parametrize("name", GROUP_BASELINE)
def test_singleton_groups_are_zero(name):
    # Unlike verl (singleton -> raw reward), a group of one gets 0.
    adv, stats = compute(name, T([3.0, 1.0, 2.0]), 1, lengths=T([1, 2, 3]), return_stats=True)
    assert torch.equal(adv, torch.zeros(3))
    assert stats["frac_zero_std"] == 1.0 and stats["num_groups"] == 3


@pytest.mark.parametrize("name", GROUP_BASELINE)
def test_nonfinite_rewards_excluded(name):
    # Group [1, nan, 0, 1] must equal group [1, 0, 1] with a 0 inserted for the NaN entry.
    lengths = T([10, 20, 30, 40, 10, 20, 30, 40])
    r = T([1.0, float("nan"), 0.0, 1.0, 0.0, float("inf"), 1.0, float("-inf")])
    adv, stats = compute(name, r, 4, lengths=lengths, return_stats=True)
    assert torch.isfinite(adv).all()
    assert adv[1] == 0 and adv[5] == 0 and adv[7] == 0
    assert stats["num_nonfinite"] == 3
    ref = compute(name, T([1.0, 0.0, 1.0, 0.0, 1.0]), group_ids=T([0, 0, 0, 1, 1]),
                  lengths=T([10, 30, 40, 10, 30]))
    close(adv[[0, 2, 3, 4, 6]], ref.tolist())


def test_grpo_nonfinite_golden():
    # [1, nan, 0, 1]: finite [1,0,1], mean 2/3, Bessel std 0.57735
    # -> [0.57735, 0, -1.154701, 0.57735]
    adv = compute("grpo", T([1.0, float("nan"), 0.0, 1.0]), 4, eps=0.0)
    close(adv, [0.577350, 0.0, -1.154701, 0.577350])


def test_all_nonfinite_and_empty():
    adv, stats = compute("grpo", T([float("nan")] * 4), 2, return_stats=True)
    assert torch.equal(adv, torch.zeros(4))
    assert stats["num_nonfinite"] == 4 and stats["frac_zero_std"] == 1.0 and stats["adv_std"] == 0.0
    adv, stats = compute("grpo", torch.zeros(0), 4, return_stats=True)
    assert adv.shape == (0,) and stats["num_groups"] == 0 and stats["frac_zero_std"] == 0.0


def test_stats_values():
    # groups [1,0,0,1] (varied) and [1,1,1,1] (zero std): frac_zero_std = 0.5
    adv, stats = compute("dr_grpo", T([1.0, 0, 0, 1, 1, 1, 1, 1]), 4, return_stats=True)
    assert stats["frac_zero_std"] == 0.5
    assert stats["num_groups"] == 2 and stats["num_nonfinite"] == 0
    assert stats["adv_mean"] == pytest.approx(0.0)
    assert stats["adv_std"] == pytest.approx(float(adv.std()))
    assert stats["reward_mean"] == pytest.approx(0.75)
    assert all(isinstance(v, (int, float)) for v in stats.values())


def test_dtype_preserved_and_int_rewards():
    assert compute("grpo", T([1.0, 0.0], dtype=torch.bfloat16), 2).dtype == torch.bfloat16
    assert compute("grpo", T([1.0, 0.0], dtype=F64), 2).dtype == F64
    assert compute("grpo", T([1, 0]), 2).dtype == torch.get_default_dtype()


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_unknown_estimator_suggests():
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        compute("grpoo", T([1.0, 0.0]), 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=T([1.0, 0, 1]), group_size=2), "not divisible"),
        (dict(rewards=T([[1.0, 0]]), group_size=2), "flat"),
        (dict(rewards=T([1.0, 0]), group_size=0), "positive int"),
        (dict(rewards=T([1.0, 0])), "exactly one"),
        (dict(rewards=T([1.0, 0]), group_size=2, group_ids=T([0, 0])), "exactly one"),
        (dict(rewards=T([1.0, 0]), group_ids=T([0, 0, 1])), "group_ids must have shape"),
        (dict(rewards=T([1.0, 0]), group_ids=T([0.0, 1.0])), "integer"),
        (dict(rewards=T([1.0, 0]), group_size=2, lengths=T([1, 2, 3])), "lengths must have shape"),
        (dict(rewards=T([1.0, 0]), group_size=2, lengths=T([1, -2])), "lengths must be finite"),
        (dict(rewards=T([1.0, 0]), group_size=2, buckets=[5]), "buckets need lengths"),
        (dict(rewards=T([1.0, 0]), group_size=2, buckets=[5, 2], lengths=T([1, 2])), "ascending"),
        (dict(rewards=T([1.0, 0]), group_size=2, eps=-1.0), "eps"),
    ],
)
def test_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute("grpo", **kwargs)


def test_register_estimator():
    @advantages.register_estimator("_test_const")
    def _const(r, cells, *, eps, lengths=None):
        return torch.ones_like(r)

    try:
        assert torch.equal(compute("_test_const", T([1.0, float("nan")]), 2), T([1.0, 0.0]))
        with pytest.raises(ValueError, match="already registered"):
            advantages.register_estimator("_test_const", _const)
    finally:
        del ESTIMATORS["_test_const"]


# ---------------------------------------------------------------------------------------------
# Length buckets
# ---------------------------------------------------------------------------------------------


def test_buckets_two_buckets_hand_worked():
    # One group of 6, edges [300]: bucket 0 = lengths {100,120,150} rewards [1,0,1] (mean 2/3),
    # bucket 1 = {500,600,700} rewards [1,0,0] (mean 1/3).
    # dr_grpo: [1/3, -2/3, 1/3, 2/3, -1/3, -1/3]  (without buckets: group mean 1/2 -> ±1/2)
    # grpo: bucket Bessel std = sqrt((1/9+4/9+1/9)/2) = 0.577350
    #   -> [0.577350, -1.154701, 0.577350, 1.154701, -0.577350, -0.577350]
    r = T([1.0, 0, 1, 1, 0, 0])
    lengths = T([100, 120, 150, 500, 600, 700])
    third = [1 / 3, -2 / 3, 1 / 3, 2 / 3, -1 / 3, -1 / 3]
    close(compute("dr_grpo", r, 6, lengths=lengths, buckets=[300]), third)
    close(compute("grpo", r, 6, lengths=lengths, buckets=[300], eps=0.0),
          [0.577350, -1.154701, 0.577350, 1.154701, -0.577350, -0.577350])
    close(compute("dr_grpo", r, 6, lengths=lengths), [0.5, -0.5, 0.5, 0.5, -0.5, -0.5])
    # rloo in bucket 0: 1 - mean(0,1) = 0.5, 0 - mean(1,1) = -1;
    #      in bucket 1: 1 - mean(0,0) = 1, 0 - mean(1,0) = -0.5
    close(compute("rloo", r, 6, lengths=lengths, buckets=[300]), [0.5, -1.0, 0.5, 1.0, -0.5, -0.5])


def test_buckets_singleton_falls_back_to_group():
    # edges [300, 1000]: bucket 2 holds only the 2000-token completion (reward 0) -> it uses the
    # whole-group mean 1/2 -> -0.5. Bucket 1 = {500, 600} rewards [1, 0] -> ±0.5; bucket 0 as above.
    r = T([1.0, 0, 1, 1, 0, 0])
    lengths = T([100, 120, 150, 500, 600, 2000])
    adv, stats = compute("dr_grpo", r, 6, lengths=lengths, buckets=[300, 1000], return_stats=True)
    close(adv, [1 / 3, -2 / 3, 1 / 3, 0.5, -0.5, -0.5])
    assert stats["num_bucket_fallback"] == 1


def test_bucket_edge_goes_up_and_groups_are_separate():
    # A length equal to an edge belongs to the upper bucket: [e_{k-1}, e_k).
    # Two groups share edges [10]; buckets never mix groups.
    r = T([1.0, 0.0, 3.0, 5.0, 1.0, 0.0, 3.0, 5.0])
    lengths = T([9, 9, 10, 12, 9, 9, 10, 12])
    adv = compute("dr_grpo", r, 4, lengths=lengths, buckets=[10])
    close(adv, [0.5, -0.5, -1.0, 1.0] * 2)


def test_quantile_buckets():
    # Group lengths [100, 400, 200, 300], q=[0.5] -> edge 250 -> buckets {100, 200} and {300, 400}.
    lengths = T([100, 400, 200, 300, 1, 2, 3, 4])
    edges = quantile_edges(lengths, 4, [0.5])
    close(edges[:, 0], [250.0] * 4 + [2.5] * 4)
    r = T([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    # group 0: bucket {100: r1, 200: r0} -> ±0.5 ; bucket {400: r1, 300: r0} -> ±0.5
    # group 1: bucket {1: r1, 2: r0} -> ±0.5 ; bucket {3, 4} all 0 -> 0
    expected = [0.5, 0.5, -0.5, -0.5, 0.5, -0.5, 0.0, 0.0]
    adv = compute("dr_grpo", r, 4, lengths=lengths, buckets=[0.5], bucket_mode="quantiles")
    close(adv, expected)
    close(compute("dr_grpo", r, 4, lengths=lengths, buckets=edges), expected)


def test_quantile_edges_match_torch_quantile():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 500, (30,), generator=g).double()
    ids = torch.randint(0, 4, (30,), generator=g)
    q = [0.1, 0.33, 0.5, 0.9]
    edges = quantile_edges(lengths, ids, q)
    for k in ids.unique():
        expected = torch.quantile(lengths[ids == k], T(q, dtype=F64))
        for row in edges[ids == k]:
            torch.testing.assert_close(row, expected)


def test_buckets_with_batch_level_estimators():
    # reinforce_pp_baseline uses bucket means in its group step:
    # centred [1/3,-2/3,1/3,2/3,-1/3,-1/3],
    # Bessel std over the batch = sqrt((1/9+4/9+1/9+4/9+1/9+1/9)/5) = sqrt(12/45) = 0.516398
    r = T([1.0, 0, 1, 1, 0, 0])
    lengths = T([100, 120, 150, 500, 600, 700])
    centred = torch.tensor([1 / 3, -2 / 3, 1 / 3, 2 / 3, -1 / 3, -1 / 3], dtype=F64)
    adv = compute("reinforce_pp_baseline", r, 6, lengths=lengths, buckets=[300], eps=0.0)
    close(adv, (centred / math.sqrt(12 / 45)).tolist())
    # batch_std divides by the raw-reward batch std: sqrt(6*0.25/5) = 0.547723
    adv = compute("batch_std", r, 6, lengths=lengths, buckets=[300], eps=0.0)
    close(adv, (centred / math.sqrt(0.3)).tolist())


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

reward_values = st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 3.0])


@st.composite
def grouped_rewards(draw, max_groups=5, max_size=6):
    g = draw(st.integers(1, max_size))
    k = draw(st.integers(1, max_groups))
    r = draw(st.lists(reward_values, min_size=g * k, max_size=g * k))
    return T(r, dtype=F64), g


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(), st.floats(0.1, 10.0), st.floats(-100.0, 100.0))
def test_grpo_affine_invariant(rg, a, b):
    r, g = rg
    adv = compute("grpo", r, g, eps=0.0)
    adv2 = compute("grpo", a * r + b, g, eps=0.0)
    torch.testing.assert_close(adv2, adv, atol=1e-8, rtol=1e-8)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards())
def test_rloo_is_scaled_dr_grpo(rg):
    r, g = rg
    expected = compute("dr_grpo", r, g) * (g / (g - 1) if g > 1 else 0.0)
    torch.testing.assert_close(compute("rloo", r, g), expected, atol=1e-12, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(), st.sampled_from(GROUP_BASELINE))
def test_zero_variance_groups_exactly_zero_and_sign_values(rg, name):
    r, g = rg
    lengths = torch.arange(1, r.numel() + 1)
    adv = compute(name, r, g, lengths=lengths)
    groups = r.view(-1, g)
    const = (groups == groups[:, :1]).all(-1)  # [K]
    assert torch.isfinite(adv).all()
    assert torch.equal(adv.view(-1, g)[const], torch.zeros_like(groups[const]))
    s = compute("sign", r, g)
    assert set(s.tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.equal(s, torch.sign(compute("grpo", r, g)))


@settings(max_examples=50, deadline=None)
@given(
    grouped_rewards(max_groups=3, max_size=8),
    st.lists(st.integers(1, 300), min_size=1, max_size=3),
)
def test_buckets_equal_plain_when_one_bucket_or_all_fallback(rg, edges):
    r, g = rg
    same = torch.full((r.numel(),), 7)  # every completion in the same bucket
    # lengths 0..g-1 in each group with edges 0.5, 1.5, ...: every bucket is a singleton
    distinct = torch.arange(r.numel()) % g
    singleton_edges = [i + 0.5 for i in range(g)]
    for name in ("grpo", "dr_grpo", "rloo", "opo"):
        plain = compute(name, r, g, lengths=same)
        torch.testing.assert_close(compute(name, r, g, lengths=same, buckets=sorted(edges)), plain)
        plain = compute(name, r, g, lengths=distinct)
        bucketed, stats = compute(
            name, r, g, lengths=distinct, buckets=singleton_edges, return_stats=True
        )
        torch.testing.assert_close(bucketed, plain)
        assert stats["num_bucket_fallback"] == r.numel()


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(), st.sampled_from(sorted(ESTIMATORS)))
def test_every_estimator_is_finite_with_eps_zero(rg, name):
    """eps = 0 is allowed: a batch whose std is 0 (all groups constant) gives 0, not 0/0."""
    r, g = rg
    adv = compute(name, r, g, eps=0.0, lengths=torch.arange(1, r.numel() + 1))
    assert torch.isfinite(adv).all()
    groups = r.view(-1, g)
    const = (groups == groups[:, :1]).all(-1)
    assert torch.equal(adv.view(-1, g)[const], torch.zeros_like(groups[const]))


@pytest.mark.parametrize("name", ["reinforce_pp_baseline", "batch_std"])
def test_batch_level_estimators_all_constant_batch_eps_zero(name):
    assert compute(name, T([1.0, 1.0, 2.0, 2.0], dtype=F64), 2, eps=0.0).tolist() == [0.0] * 4
    assert compute(name, T([1.0, float("nan")], dtype=F64), 2, eps=0.0).tolist() == [0.0, 0.0]


def test_sign_tolerance_is_per_completion_not_per_batch():
    # a group with large rewards must not blur another group's small (but real) differences
    r = T([1e8, 0.0, 1.0, 1.0000001], dtype=F64)
    assert compute("sign", r, 2).tolist() == [1.0, -1.0, -1.0, 1.0]
    assert torch.equal(compute("sign", r, 2), torch.sign(compute("grpo", r, 2)))


def test_eps_must_be_finite_and_numpy_group_sizes_work():
    import numpy as np
    r = T([0.0, 1.0, 1.0, 1.0], dtype=F64)
    for bad in (float("nan"), float("inf"), -1.0, True):
        with pytest.raises(ValueError, match="eps"):
            compute("grpo", r, 2, eps=bad)
    assert torch.equal(compute("grpo", r, np.int64(2)), compute("grpo", r, 2))
