"""The LM head's fused log-probs (grpokit/csrc/head_logp.c through grpokit.train.head) against
PyTorch: values in float64, gradients against the PyTorch path's autograd, non-finite rows, the
cases that must take PyTorch's path, and the whole completion log-prob with the kernels on and off."""

import copy
import ctypes

import pytest
import torch

from grpokit import cbuild
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train import head
from grpokit.train.logprobs import _head_logprobs, build_micro_batch, completion_logprobs
from tests.fixtures import op_calls

pytestmark = pytest.mark.skipif(cbuild.compiler() is None or cbuild.off(),
                                reason="no C compiler here (or GRPOKIT_NATIVE=0): PyTorch's path is used")


@pytest.fixture(scope="module")
def fns():
    """The kernels as built, without the self-check that would hide a wrong one behind PyTorch's path."""
    return head._bind(ctypes.CDLL(str(cbuild.build(head.SOURCE))))


@pytest.fixture
def raw(fns):
    """`grpokit.train.head` running the unchecked kernels."""
    saved = head._state.get("fns")
    head._state["fns"] = fns
    yield fns
    head._state["fns"] = saved


def test_the_kernels_build_and_pass_their_check_where_a_compiler_is():
    assert head.kernels() is not None


def _stats64(x, t, inv_t):
    z = x.double() * inv_t
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    return z.gather(-1, t[:, None]).squeeze(-1) - lse, lse, -(p * torch.log_softmax(z, -1)).sum(-1)


@pytest.mark.parametrize("n,V,temperature,spread", [(7, 5003, 1.0, 4.0), (2, 8, 0.6, 1.0), (16, 12000, 1.3, 15.0),
                                                    (3, 49152, 0.8, 6.0), (5, 9, 1.0, 0.0)])
def test_row_statistics_match_float64(fns, n, V, temperature, spread):
    g = torch.Generator().manual_seed(n * V)
    x = torch.randn(n, V, generator=g) * spread
    x[0, -1] = 40.0                                        # a near-certain token: entropy near 0
    t = torch.randint(0, V, (n,), generator=g)
    t[0] = V - 1
    logp, lse, ent = head._stats(fns, x, t, 1 / temperature, True)
    want = _stats64(x, t, 1 / temperature)
    for got, ref in zip((logp, lse, ent), want):
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("keep_logits", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_equal_the_pytorch_path(raw, keep_logits, temperature):
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(24, 301, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(301, 24, generator=g))
    h0 = torch.randn(3, 5, 24, generator=g)
    t = torch.randint(0, 301, (3, 5), generator=g)
    w_out = torch.randn(3, 5, generator=g)
    w_out[2, 3:] = 0.0                                     # padding positions: no gradient
    grads, outs = [], []
    for fused in (True, False):
        lin.weight.grad = None
        h = h0.clone().requires_grad_(True)
        if fused:
            assert head.applies(lin, None, True, h, t)
            lp, ent = head.logprobs(h, lin.weight, t, temperature, True, keep_logits=keep_logits)
        else:
            lp, ent = _head_logprobs(lin, None, temperature, h, t, True)
        (lp * w_out).sum().backward()
        outs.append((lp.detach(), ent))
        grads.append((h.grad, lin.weight.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert not outs[0][1].requires_grad                    # the entropy is a detached signal


def test_non_finite_rows_come_out_as_pytorch_computes_them(raw):
    lin = torch.nn.Linear(8, 50, bias=False)
    h = torch.randn(1, 4, 8)
    h[0, 1, 2] = float("nan")
    h[0, 3, 0] = float("inf")
    t = torch.tensor([[1, 2, 3, 4]])
    got, _ = head.logprobs(h, lin.weight, t, 1.0, True)
    want, _ = _head_logprobs(lin, None, 1.0, h, t, True)
    assert torch.isfinite(got[0, [0, 2]]).all()
    torch.testing.assert_close(got[0, [0, 2]], want[0, [0, 2]])
    for j in (1, 3):                                       # non-finite where PyTorch's are
        assert not torch.isfinite(got[0, j]) and not torch.isfinite(want[0, j])


def test_the_cases_it_leaves_to_pytorch(raw):
    h = torch.randn(2, 3, 8)
    t = torch.randint(0, 20, (2, 3))
    plain = torch.nn.Linear(8, 20, bias=False)
    assert head.applies(plain, None, True, h, t)
    assert not head.applies(torch.nn.Linear(8, 20), None, True, h, t)           # a bias
    assert not head.applies(plain, 30.0, True, h, t)                            # soft-capped logits
    assert not head.applies(plain, None, "grad", h, t)                          # a differentiable entropy
    assert not head.applies(copy.deepcopy(plain).to(torch.bfloat16), None, True, h.bfloat16(), t)
    assert not head.applies(plain, None, True, h, t + 20)                       # targets past the vocabulary
    hook = plain.register_forward_hook(lambda mod, args, out: out)             # a hook must see the forward
    assert not head.applies(plain, None, True, h, t)
    hook.remove()
    assert head.applies(plain, None, True, h, t)
    saved = head._state["fns"]
    head._state["fns"] = None                                                   # the kernels unavailable
    try:
        assert not head.applies(plain, None, True, h, t)
    finally:
        head._state["fns"] = saved


def test_completion_logprobs_with_and_without_the_kernels(raw):
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, arch="qwen2", hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                             max_positions=64, seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [tok(p)["input_ids"] for p in ("12+34=", "5=", "12+34=", "9+9=")]
    comps = torch.randint(3, 12, (4, 6), generator=g)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 4, 1])[:, None]).long()
    mb = build_micro_batch(list(range(4)), prompts, comps, mask, tok.pad_token_id)
    results = []
    saved = head._state["fns"]
    try:
        for fns in (saved, None):
            head._state["fns"] = fns
            model.zero_grad(set_to_none=True)
            lp, ent = completion_logprobs(model, mb, temperature=0.9, want_entropy=True)
            (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
            results.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    finally:
        head._state["fns"] = saved
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert (lp_a[mask == 0] == 0).all() and (ent_a[mask == 0] == 0).all()
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_a, ent_b, rtol=1e-4, atol=1e-4)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_head_weight_gradient_added_in_place_over_micro_batches(raw):
    """Three micro-batches under `gemm.grads_in_place` (the worker's backward): the head's weight
    gradient from the second on is added into `.grad` by its GEMM, and the sum equals PyTorch's path
    accumulated by autograd."""
    from grpokit import gemm
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(24, 301, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(301, 24, generator=g))
    mbs = [(torch.randn(2 + k, 4, 24, generator=g), torch.randint(0, 301, (2 + k, 4), generator=g)) for k in range(3)]
    saved = dict(gemm._state["use"])
    gemm._state["use"]["head_grad_weight"] = False          # the BLAS GEMM, which adds with beta = 1
    grads, added = [], []
    try:
        for fused in (True, False):
            lin.weight.grad = None
            for h, t in mbs:
                if fused:
                    with gemm.grads_in_place():
                        added.append(op_calls(lambda: head.logprobs(h, lin.weight, t, 0.8, False)[0].sum().backward(),
                                              "aten::addmm_"))
                else:
                    _head_logprobs(lin, None, 0.8, h, t, False)[0].sum().backward()
            grads.append(lin.weight.grad.clone())
    finally:
        gemm._state["use"] = saved
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert added == [0, 1, 1]                               # the first micro-batch finds no .grad
