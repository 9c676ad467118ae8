"""The sampler's draw (`grpokit.rollout.base.draw`, inverse transform sampling) against the exact
categorical distribution: many draws, a chi-square goodness-of-fit test and the total-variation
distance, zero-probability tokens never drawn, and seeded determinism."""

import numpy as np
import pytest
import torch

from grpokit.rollout.base import SamplingParams, draw, inverse_cdf, sample_next

N = 200_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square statistic of `counts` against `probs` (tokens with mass only):
    P(X >= stat) for X ~ chi-square with k - 1 degrees of freedom, the regularised upper incomplete
    gamma function Q(df / 2, stat / 2)."""
    keep = probs > 0
    n = counts.sum()
    expected = n * probs[keep].double()
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _distribution() -> torch.Tensor:
    """A small vocabulary with a dominant token, rare tokens and two masked (zero) tokens."""
    logits = torch.tensor([2.0, 0.5, -1.0, float("-inf"), 0.0, -3.0, float("-inf"), 1.0, -5.0, 0.3])
    return torch.softmax(logits, -1)


def test_draws_follow_the_exact_distribution():
    probs = _distribution()
    gen = torch.Generator().manual_seed(0)
    tok = draw(probs.expand(N, -1), gen)
    counts = torch.bincount(tok, minlength=len(probs))
    assert counts[probs == 0].sum() == 0                     # masked tokens never drawn
    assert chi_square_p_value(counts, probs) > 1e-3
    # total variation between the empirical and the exact distribution: its expectation under exact
    # sampling is about sum_i sqrt(p_i (1 - p_i) / (2 pi N)) ~ 0.002 here
    tv = 0.5 * (counts.double() / N - probs.double()).abs().sum()
    assert tv < 0.006


def test_each_row_draws_from_its_own_distribution():
    torch.manual_seed(1)
    dists = torch.softmax(torch.randn(3, 6) * 2, -1)                    # three different rows
    dists[1, 2] = 0.0                                                   # unnormalised, with a hole
    probs = dists.repeat(N // 3, 1)                                     # rows cycle 0, 1, 2, 0, ...
    tok = draw(probs, torch.Generator().manual_seed(2))
    for r in range(3):
        counts = torch.bincount(tok[r::3], minlength=6)
        target = dists[r] / dists[r].sum()
        assert counts[target == 0].sum() == 0
        assert chi_square_p_value(counts, target) > 1e-3, r


def test_the_test_rejects_a_wrong_distribution():
    """The chi-square check above has power: draws from a distribution that differs from the
    exact one by moving 1% of the mass between two tokens are rejected."""
    probs = _distribution()
    wrong = probs.clone()
    wrong[0] -= 0.01
    wrong[1] += 0.01
    counts = torch.bincount(draw(wrong.expand(N, -1), torch.Generator().manual_seed(0)), minlength=len(probs))
    assert chi_square_p_value(counts, probs) < 1e-6


@pytest.mark.parametrize("block", [1024, 2, 3])   # one level; two levels with zero-mass blocks
def test_quantiles_at_the_edges_pick_tokens_with_mass(block):
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    cases = {0.0: 1, 0.2499: 1, 0.25: 3, 0.7499: 3, 0.75: 4, float(below_one): 4}
    for u, want in cases.items():
        assert int(inverse_cdf(probs, torch.tensor([u], dtype=torch.float64), block)) == want, u
    # a quantile at the total (what rounding of u * total can give) still lands on a token with mass
    assert int(inverse_cdf(probs, torch.tensor([1.0], dtype=torch.float64), block)) == 4


def test_seeded_draws_are_deterministic():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, top_p=0.95)
    a = sample_next(logits, params, torch.Generator().manual_seed(7))
    b = sample_next(logits, params, torch.Generator().manual_seed(7))
    c = sample_next(logits, params, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_sample_next_frequencies_match_its_recorded_logprobs():
    """Through temperature and top-p: each token's frequency is exp(recorded log-prob)."""
    logits = torch.tensor([[1.5, 1.0, 0.2, -0.5, -2.0, 0.7]]).expand(N, -1)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    tok, lp, _ = sample_next(logits, params, torch.Generator().manual_seed(4))
    probs = torch.zeros(6, dtype=torch.float64)
    probs[tok] = lp.double().exp()                        # the distribution sampled from, as recorded
    # independent re-computation: temperature, then the smallest top set with mass >= 0.9
    p = torch.softmax(logits[0].double() / 0.7, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(6, dtype=torch.bool)
    keep[order[:int((p[order].cumsum(0) < 0.9).sum()) + 1]] = True
    exact = torch.where(keep, p, 0.0) / p[keep].sum()
    torch.testing.assert_close(probs, exact, atol=1e-6, rtol=1e-5)
    counts = torch.bincount(tok, minlength=6)
    assert counts[~keep].sum() == 0
    assert chi_square_p_value(counts, exact) > 1e-3


@pytest.mark.parametrize("V, block", [(49152, 1024), (1000, 64), (5000, 1024), (100, 1024)])
def test_inverse_cdf_in_blocks_equals_the_full_cumulative_sum(V, block):
    """The two-level search (block masses, then inside one block) picks the token a plain float64
    cumulative sum over the whole row picks (numpy, independently), with whole blocks of zero mass,
    a ragged last block and rows that do not sum to 1."""
    g = torch.Generator().manual_seed(V)
    probs = torch.softmax(torch.randn(6, V, generator=g) * 4, -1)
    probs[1, : V // 2] = 0                      # the first half of the row (whole blocks) has no mass
    probs[2] *= 3.0                             # not normalised
    probs[3, :-1] = 0                           # all mass on the last token (in the ragged tail)
    probs[3, -1] = 1.0
    probs[4, ::7] = 0
    u = torch.rand(6, 200, dtype=torch.float64, generator=g)
    ref_cdf = np.cumsum(probs.double().numpy(), -1)
    for k in range(u.shape[1]):
        got = inverse_cdf(probs, u[:, k], block=block)
        for r in range(6):
            want = int(np.searchsorted(ref_cdf[r], u[r, k].item() * ref_cdf[r, -1], side="right"))
            assert int(got[r]) == min(want, V - 1), (r, k)
            assert probs[r, got[r]] > 0
