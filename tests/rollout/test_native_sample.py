"""The sampler's native plain path (grpokit/csrc/sample.c through grpokit.rollout.native_sample, used
by `sample_next` at a temperature with no top-k / top-p / resampling) against the exact categorical
distribution and against PyTorch's path: chi-square and total variation, recorded log-probs equal
to float64 re-computation, the quantile's interval over a 49,152-token vocabulary, the same tokens
as PyTorch's path from the same seed, independence from the thread count, non-finite rows."""

import numpy as np
import pytest
import torch

from grpokit import cbuild
from grpokit.rollout import native_sample
from grpokit.rollout.base import NonFiniteLogits, SamplingParams, sample_next
from tests.rollout.test_sampling import N, chi_square_p_value

pytestmark = pytest.mark.skipif(cbuild.compiler() is None or cbuild.off(),
                                reason="no C compiler here (or GRPOKIT_NATIVE=0): PyTorch's sampler is used")


@pytest.fixture
def torch_path(monkeypatch):
    """Within the test, sample_next runs PyTorch's path (the native function taken away)."""
    def use():
        monkeypatch.setitem(native_sample._state, "fn", None)
    return use


def _logits() -> torch.Tensor:
    """A small vocabulary with a dominant token, rare tokens and two masked tokens."""
    return torch.tensor([2.0, 0.5, -1.0, float("-inf"), 0.0, -3.0, float("-inf"), 1.0, -5.0, 0.3])


def test_the_kernel_builds_and_passes_its_check_where_a_compiler_is():
    assert native_sample.sample_fn() is not None


def test_native_draws_follow_the_exact_distribution_and_record_its_logprobs():
    T = 0.7
    logits = _logits().expand(N, -1).contiguous()
    tok, lp, res = sample_next(logits, SamplingParams(temperature=T), torch.Generator().manual_seed(0))
    exact = torch.softmax(_logits().double() / T, -1)           # independent re-computation
    counts = torch.bincount(tok, minlength=len(exact))
    assert counts[exact == 0].sum() == 0                         # masked tokens never drawn
    assert chi_square_p_value(counts, exact) > 1e-3
    tv = 0.5 * (counts.double() / N - exact).abs().sum()
    assert tv < 0.006                                            # expected ~0.002 under exact sampling
    torch.testing.assert_close(lp.double(), exact[tok].log(), atol=2e-6, rtol=0)
    assert not res.any()


def test_the_test_has_power_against_a_slightly_wrong_temperature():
    logits = _logits().expand(N, -1).contiguous()
    tok, _, _ = sample_next(logits, SamplingParams(temperature=0.75), torch.Generator().manual_seed(0))
    exact = torch.softmax(_logits().double() / 0.7, -1)
    assert chi_square_p_value(torch.bincount(tok, minlength=10), exact) < 1e-6


@pytest.mark.parametrize("V", [49152, 5000, 1003])
def test_each_token_holds_its_quantile_over_a_large_vocabulary(V):
    """At given quantiles (a PromptStreams' path), the drawn token's interval of a float64
    cumulative sum (numpy, independently) holds u * total, up to rounding, and has mass; rows with
    whole masked blocks, all mass on the last token (the ragged tail), a spread of 8 at T = 0.6."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g) * 8
    x[1, : V // 2] = float("-inf")
    x[2, :-1] = float("-inf")
    x[4, ::7] = float("-inf")
    x[5, V // 3] = 80.0
    p = torch.softmax(x.double() / 0.6, -1).numpy()
    cdf = np.cumsum(p, -1)
    params = SamplingParams(temperature=0.6)
    for _ in range(40):
        u = torch.rand(6, dtype=torch.float64, generator=g)
        tok, lp, _ = sample_next(x, params, None, u)
        for r in range(6):
            t = int(tok[r])
            lo = cdf[r, t - 1] if t else 0.0
            target = float(u[r]) * cdf[r, -1]
            assert p[r, t] > 0
            assert lo - 1e-9 <= target <= cdf[r, t] + 1e-9, (r, t)
            assert abs(float(lp[r]) - np.log(p[r, t])) < 1e-5 * max(1.0, abs(np.log(p[r, t])))


def test_the_same_tokens_as_pytorchs_path_from_the_same_seed(torch_path):
    """The same random numbers drawn the same way: the same tokens (they could differ only where a
    quantile falls within float rounding of a boundary), and log-probs within float32 rounding."""
    x = torch.randn(64, 3000, generator=torch.Generator().manual_seed(5)) * 3
    params = SamplingParams(temperature=0.8)
    native = [sample_next(x, params, torch.Generator().manual_seed(s)) for s in range(20)]
    torch_path()
    theirs = [sample_next(x, params, torch.Generator().manual_seed(s)) for s in range(20)]
    for (a, la, _), (b, lb, _) in zip(native, theirs):
        assert torch.equal(a, b)
        torch.testing.assert_close(la, lb, atol=2e-5, rtol=1e-5)


def test_one_and_two_threads_draw_the_same():
    x = torch.randn(33, 4100, generator=torch.Generator().manual_seed(6)) * 4
    u = torch.rand(33, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    a = native_sample.sample(x, 1.25, u, threads=1)
    b = native_sample.sample(x, 1.25, u, threads=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_a_row_without_a_distribution_raises_as_pytorchs_path_does(bad):
    x = torch.randn(4, 300)
    if bad == "all -inf":
        x[2] = float("-inf")
    else:
        x[2, 17] = bad
    with pytest.raises(NonFiniteLogits, match="1 of 4 rows"):
        sample_next(x, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))


def test_other_settings_and_tensors_take_pytorchs_path(monkeypatch):
    """top-p, top-k, resampling, greedy, float64 or non-contiguous logits never reach the kernel."""
    calls = []
    real = native_sample.sample
    monkeypatch.setattr(native_sample, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(8, 200)
    gen = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=5),
                   SamplingParams(temperature=0.8, resample_threshold=0.9), SamplingParams(temperature=0.0)):
        sample_next(x, params, gen)
    sample_next(x.double(), SamplingParams(temperature=0.8), gen)
    sample_next(torch.randn(200, 8).t(), SamplingParams(temperature=0.8), gen)
    assert calls == []
    sample_next(x, SamplingParams(temperature=0.8), gen)
    assert calls == [1]


def test_a_kernel_that_declines_after_the_draw_leaves_pytorch_the_same_numbers(monkeypatch):
    """The random numbers are drawn once: where the kernel gives no result after they were drawn,
    PyTorch's path samples at those same quantiles (the stream is not advanced twice)."""
    x = torch.randn(16, 2000, generator=torch.Generator().manual_seed(9)) * 3
    params = SamplingParams(temperature=0.9)
    gen = torch.Generator().manual_seed(3)
    want = [sample_next(x, params, gen)[0] for _ in range(3)]
    monkeypatch.setattr(native_sample, "sample", lambda *a, **k: None)
    gen = torch.Generator().manual_seed(3)
    got = [sample_next(x, params, gen)[0] for _ in range(3)]
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_logits_far_past_the_temperature_scale_are_declined_and_near_it_exact():
    """z = x / T of 2^20 or more: the kernel declines (PyTorch's path samples); just below, the
    largest logit takes all the mass, and a row with ties splits it evenly."""
    u = torch.tensor([0.5, 0.5], dtype=torch.float64)
    far = torch.tensor([[3.0, 2.0, 1.0e4], [1.0, 0.5, 0.0]])
    assert native_sample.sample(far, 1e36, u) is None
    assert native_sample.sample(far, 200.0, u) is None                       # 2e6 > 2^20
    near = torch.tensor([[3.0, 2.0, 1.0e3], [7.0, 7.0, -1.0]])
    tok, lp, bad = native_sample.sample(near, 1000.0, torch.tensor([0.3, 0.75], dtype=torch.float64))
    assert bad == 0
    assert tok.tolist() == [2, 1]
    torch.testing.assert_close(lp, torch.tensor([0.0, -0.6931472]), atol=1e-6, rtol=0)
    params = SamplingParams(temperature=1 / 200)          # through sample_next: PyTorch's path draws
    assert sample_next(far, params, None, u)[0].tolist() == [2, 0]
