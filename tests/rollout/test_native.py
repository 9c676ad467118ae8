"""The native decode attention (grpokit/csrc/attend.c through grpokit.rollout.native) against
the eager computation it replaces, and the lean decoder's two cache layouts against each other."""

import subprocess
import sys

import pytest
import torch

from grpokit.rollout import native
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.decoder import LeanDecoder
from grpokit.rollout.hf import HFEngine
from tests.rollout.test_lean import PROMPTS, _model

from grpokit import cbuild

pytestmark = pytest.mark.skipif(cbuild.compiler() is None or cbuild.off(),
                                reason="no C compiler here (or GRPOKIT_NATIVE=0): the eager path is used")


def test_the_kernel_builds_and_passes_its_check_where_a_compiler_is():
    assert native.attend_fn() is not None           # a failed build or self-check fails here, not skips


def _case(g, n, nkv, r, d, L, B=0, P=0, masked=False):
    q = torch.randn(n, nkv * r, d, generator=g)
    k, v = torch.randn(n, nkv, L, d, generator=g) * 2, torch.randn(n, nkv, L, d, generator=g)
    mask = torch.rand(n, L, generator=g) > 0.4 if masked else None
    prefix = None
    if P:
        pmask = torch.rand(B, P, generator=g) > 0.4 if masked else None
        if pmask is not None:
            pmask[:, -1] = True
        prefix = (torch.randn(B, nkv, P, d, generator=g), torch.randn(B, nkv, P, d, generator=g), pmask,
                  torch.randint(0, B, (n,), generator=g))
    return q, k, v, mask, prefix


@pytest.mark.parametrize("n,nkv,r,d,L,B,P,masked", [
    (64, 3, 3, 64, 90, 0, 0, False),      # SmolLM2's heads
    (7, 2, 4, 128, 33, 0, 0, True),       # a 128-wide head, padding
    (5, 4, 1, 72, 19, 0, 0, False),       # no grouping, a head width past 64 not a multiple of 64
    (9, 1, 5, 20, 11, 0, 0, True),        # a head width not a multiple of 8: the scalar path
    (12, 3, 3, 64, 40, 3, 25, False),     # prompts kept once, shared by rows
    (12, 2, 2, 48, 17, 4, 9, True),       # ... with left padding in the prompts and a row mask
])
def test_native_attention_equals_the_eager_one(n, nkv, r, d, L, B, P, masked):
    g = torch.Generator().manual_seed(n * d + L)
    q, k, v, mask, prefix = _case(g, n, nkv, r, d, L, B, P, masked)
    for S in (1, L // 2, L):
        if mask is not None:
            mask[:, S - 1] = True
        for threads in (1, 2, 3):
            got = native.attend(q, k, v, S, mask, prefix=prefix, threads=threads)
            want = native.eager(q, k, v, S, mask, prefix=prefix)
            assert got is not None
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_strided_queries_and_a_non_default_scale():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 1, 4 + 2 * 2, 32, generator=g).transpose(1, 2)      # [n, heads, 1, d], as the decoder's
    q = qkv[:, :4].reshape(6, 4, 32)
    assert q.stride(0) == 8 * 32                                               # rows 8 heads apart, not 4
    k, v = torch.randn(6, 2, 10, 32, generator=g), torch.randn(6, 2, 10, 32, generator=g)
    got = native.attend(q, k, v, 7, scale=0.3)
    torch.testing.assert_close(got, native.eager(q, k, v, 7, scale=0.3), rtol=1e-4, atol=1e-5)


def test_non_finite_scores_reach_the_output_and_unsuitable_tensors_are_declined():
    g = torch.Generator().manual_seed(1)
    q, k, v, _, _ = _case(g, 4, 2, 2, 32, 12)
    q[2, 3, 5] = float("nan")                                   # row 2, head 3 (KV head 1)
    k[1, 0, 4, 0] = float("inf")                                # row 1, KV head 0: scores of +-inf
    k[3, 1, 2, 0] = float("-inf")
    out, want = native.attend(q, k, v, 12), native.eager(q, k, v, 12)
    assert torch.equal(torch.isfinite(out), torch.isfinite(want))       # NaN where the eager one has it
    assert not torch.isfinite(out[2, 3]).any() and torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-4, atol=1e-5)
    assert native.attend(q.double(), k.double(), v.double(), 12) is None        # float64: eager
    assert native.attend(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, 12) is None   # positions not rows
    assert native.attend(q, k, v, 13) is None                   # past the cache


@pytest.mark.parametrize("texts", [PROMPTS, ["1", "7", "3"]])          # ragged; one token each
def test_the_split_cache_decodes_what_the_expanded_one_does(texts):
    """The lean engine with the prompts kept once (`split`, native attention) against the same
    engine with the native code off (every row holding its prompt, eager attention): the same draws
    (one seeded stream per prompt) give the same tokens and close log-probs, with left padding and
    rows leaving the batch at EOS."""
    from grpokit.rollout.base import PromptStreams

    model, tok = _model("llama", eos_boost=3.0, kv_heads=2)     # grouped heads; EOS likely: rows finish apart
    prompts = [tok(p)["input_ids"] for p in texts]
    dec = LeanDecoder(model, rows=12)
    dec.alloc(12, 30, prompts=4, prefix=6)
    assert dec.split
    params = SamplingParams(n=3, max_new_tokens=14, temperature=1.0)
    seeds = list(range(1, len(prompts) + 1))
    split = HFEngine(model, tok).generate(prompts, params, PromptStreams(seeds))
    fn = native._state["fn"]
    try:
        native._state["fn"] = None
        dec.alloc(12, 30, prompts=4, prefix=6)
        assert not dec.split
        expanded = HFEngine(model, tok).generate(prompts, params, PromptStreams(seeds))
    finally:
        native._state["fn"] = fn
    assert len(set(expanded.lengths.tolist())) > 1                              # rows left the batch
    assert torch.equal(split.completion_ids, expanded.completion_ids)
    torch.testing.assert_close(split.sampler_logprobs, expanded.sampler_logprobs, atol=2e-5, rtol=1e-4)


def test_no_compiler_leaves_the_eager_path_with_one_line(tmp_path):
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stdout)\n"
            "from grpokit.rollout import native\nprint('fn', native.attend_fn())")
    env = {"PATH": "/nonexistent", "CC": "/nonexistent/cc", "GRPOKIT_CACHE": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fn None" in out.stdout
    assert "native decode attention unavailable, PyTorch instead" in out.stdout
