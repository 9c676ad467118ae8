"""The native attention over the packed training layout (grpokit/csrc/packed_attend.c) against an
independent dense-mask attention in float64: outputs and all three gradients; and the lean forward
through it against the model's own forward."""

import pytest
import torch

from grpokit.train import forward as lean
from grpokit.train import packed_attention as pa
from tests.fixtures import unchecked_kernels


RAW = unchecked_kernels(pa)      # the load-time check would hide a wrong kernel by falling back
needs_native = pytest.mark.skipif(RAW is None, reason="no native build here (no C compiler, or no AVX2 + FMA)")


def _layout(prompt_lens, rows):
    """Left-padded prompts of these real lengths; rows (prompt index, completion tokens fed)."""
    P = max(prompt_lens)
    p_att = torch.zeros(len(prompt_lens), P, dtype=torch.bool)
    for i, n in enumerate(prompt_lens):
        p_att[i, P - n:] = True
    L = max([n for _, n in rows] + [1])
    c_att = torch.arange(L)[None] < torch.tensor([n for _, n in rows])[:, None]
    return p_att, c_att, torch.tensor([u for u, _ in rows])


def _dense(q, k, v, p_att, c_att, inv):
    """Each packed token's keys from first principles: a prompt token, its prompt's tokens up to
    itself; a completion token, all of its prompt's tokens and its row's up to itself."""
    seq, pos, kind = [], [], []
    for u in range(p_att.shape[0]):
        for i in range(int(p_att[u].sum())):
            seq.append(("p", u)), pos.append(i), kind.append(None)
    for m in range(c_att.shape[0]):
        for i in range(int(c_att[m].sum())):
            seq.append(("c", m)), pos.append(i), kind.append(int(inv[m]))
    N = len(seq)
    mask = torch.zeros(N, N, dtype=torch.bool)
    for t in range(N):
        for j in range(N):
            same = seq[j] == seq[t] and pos[j] <= pos[t]
            prompt = kind[t] is not None and seq[j] == ("p", kind[t])
            mask[t, j] = same or prompt
    nh, nkv, d = q.shape[1], k.shape[1], q.shape[2]
    rep = torch.arange(nh) // (nh // nkv)
    s = torch.einsum("thc,jhc->htj", q, k[:, rep]) * d ** -0.5
    return torch.einsum("htj,jhc->thc", s.masked_fill(~mask, float("-inf")).softmax(-1), v[:, rep])


@needs_native
@pytest.mark.parametrize("nkv,r,d,prompts,rows", [
    (3, 3, 64, [49], [(0, 63)] * 3),                                        # SmolLM2's heads, one length
    (3, 3, 64, [50, 17], [(1, 5), (0, 40), (1, 1), (0, 9), (1, 0), (0, 23)]),  # ragged, interleaved prompts
    (2, 7, 16, [4, 12, 1], [(2, 3), (0, 11), (1, 2), (2, 30)]),              # 7 query heads a KV head
    (1, 1, 8, [3], [(0, 2)]),
    (4, 2, 40, [9, 9], [(0, 8), (1, 8), (1, 17), (0, 1)]),
])
def test_native_attention_and_its_gradients_equal_a_dense_masked_attention(nkv, r, d, prompts, rows):
    p_att, c_att, inv = _layout(prompts, rows)
    N = int(p_att.sum() + c_att.sum())
    g = torch.Generator().manual_seed(N)
    q, k, v, w = (torch.randn(N, h, d, generator=g, dtype=torch.float64) for h in (nkv * r, nkv, nkv, nkv * r))
    k = k * 2                                            # sharper softmax
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    want = _dense(q64, k64, v64, p_att, c_att, inv)
    g_want = torch.autograd.grad((want * w).sum(), (q64, k64, v64))
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    was = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got = pa._Attention.apply(q32, k32, v32, pa.plan(p_att, c_att, inv), d ** -0.5, RAW)
        g_got = torch.autograd.grad((got * w.float()).sum(), (q32, k32, v32))
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-3)
    torch.set_num_threads(was)


@needs_native
def test_lean_forward_through_the_native_attention_equals_the_model_forward(monkeypatch):
    """float32, where the native attention serves: the same log-probs and gradients as the model's
    own forward, and the attention calls go through the native code (and not at all with it off)."""
    assert pa.fns() is not None                          # built and passed its load-time check
    from tests.train.test_forward import _batch, _both_paths, _grads, _model
    tok, model = _model("qwen2", dtype=torch.float32)
    mb = _batch(tok, L=6)
    calls = []
    real = pa.attend
    monkeypatch.setattr(pa, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, want, g_want = _both_paths(model, mb, 0.7)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(_grads(model), g_want, atol=2e-5, rtol=1e-3)
    assert len(calls) == len(model.model.layers)
    calls.clear()
    monkeypatch.setattr(lean, "NATIVE", False)
    got_off, _, _ = _both_paths(model, mb, 0.7)
    assert not calls
    torch.testing.assert_close(got_off, got, atol=2e-5, rtol=1e-4)
