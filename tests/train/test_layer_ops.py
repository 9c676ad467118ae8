"""RMSNorm, SwiGLU and the rotary embedding as native code (grpokit/csrc/layer_ops.c) against their
definitions written out in float64: outputs and gradients, at one and two threads; the non-finite
cases; and the lean forward through them against the model's own forward."""

import pytest
import torch

from grpokit.train import forward as lean
from grpokit.train import layer_ops as lo
from tests.fixtures import unchecked_kernels


RAW = unchecked_kernels(lo)      # the load-time check would hide a wrong kernel by falling back
needs_native = pytest.mark.skipif(RAW is None, reason="no native build here (no C compiler, or no AVX2 + FMA)")


def _rms64(x, w, eps):
    """RMSNorm from its definition (Zhang & Sennrich 2019): each row over its root mean square."""
    rms = (x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps).sqrt()
    return x / rms * w


def _swiglu64(g, u):
    return g / (1 + torch.exp(-g)) * u


def _each_thread_count(fn):
    was = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            fn()
    finally:
        torch.set_num_threads(was)


@needs_native
@pytest.mark.parametrize("n,H,w_grad", [(1, 8, True), (7, 13, True), (40, 576, True), (33, 64, False), (3, 1000, True)])
def test_native_rms_norm_and_its_gradients_equal_the_definition(n, H, w_grad):
    g = torch.Generator().manual_seed(n * H)
    scales = torch.logspace(-2, 2, n, dtype=torch.float64)[:, None]       # rows of very different sizes
    x = torch.randn(n, H, generator=g, dtype=torch.float64) * scales
    w = torch.randn(H, generator=g, dtype=torch.float64)
    dy = torch.randn(n, H, generator=g, dtype=torch.float64)
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_(w_grad)
    want = _rms64(x64, w64, 1e-5)
    g_want = torch.autograd.grad((want * dy).sum(), (x64, w64) if w_grad else (x64,))

    def check():
        x32, w32 = x.float().requires_grad_(), w.float().requires_grad_(w_grad)
        got = lo._RMSNorm.apply(x32, w32, 1e-5, RAW)
        g_got = torch.autograd.grad((got * dy.float()).sum(), (x32, w32) if w_grad else (x32,))
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a.double(), b, atol=1e-4 * float(b.abs().max()), rtol=1e-4)
    _each_thread_count(check)


@needs_native
@pytest.mark.parametrize("n", [1, 8, 37, 4096 * 3 + 5])
def test_native_swiglu_and_its_gradients_equal_the_definition(n):
    g = torch.Generator().manual_seed(n)
    gate = torch.randn(n, generator=g, dtype=torch.float64) * 6
    gate[: min(n, 4)] = torch.tensor([-80.0, 80.0, 0.0, -0.0])[: min(n, 4)]    # both saturations, zero
    up, dy = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2))
    g64, u64 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    want = _swiglu64(g64, u64)
    g_want = torch.autograd.grad((want * dy).sum(), (g64, u64))

    def check():
        g32, u32 = gate.float().requires_grad_(), up.float().requires_grad_()
        got = lo._SwiGLU.apply(g32, u32, RAW)
        g_got = torch.autograd.grad((got * dy.float()).sum(), (g32, u32))
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    _each_thread_count(check)


def _check_rope(x, cos, sin, dy, want, g_want):
    """The kernel's rotation of x (cos, sin [n, 1, d]) and its input gradient against float64
    `want` and `g_want`, at one and two threads."""
    n, _, d = x.shape

    def check():
        x32 = x.float().requires_grad_()
        got = lo._Rope.apply(x32, cos.float().reshape(n, d), sin.float().reshape(n, d), RAW)
        g_got, = torch.autograd.grad((got * dy.float()).sum(), (x32,))
        torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g_got.double(), g_want, atol=1e-5, rtol=1e-5)
    _each_thread_count(check)


@needs_native
@pytest.mark.parametrize("n,heads,d", [(1, 1, 2), (9, 9, 64), (40, 3, 64), (5, 2, 36)])
def test_native_rotary_and_its_gradient_equal_a_rotation_of_each_pair(n, heads, d):
    """Each pair (x_i, x_{i + d/2}) rotated by its angle: the complex product (x_i + i x_{i+d/2}) e^{i theta}."""
    g = torch.Generator().manual_seed(n * heads * d)
    x = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    theta = torch.randn(n, d // 2, generator=g, dtype=torch.float64) * 3
    dy = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    x64 = x.clone().requires_grad_()
    z = torch.complex(x64[..., : d // 2], x64[..., d // 2:]) * torch.polar(torch.ones_like(theta), theta)[:, None]
    want = torch.cat([z.real, z.imag], -1)
    g_want, = torch.autograd.grad((want * dy).sum(), (x64,))
    cos = torch.cat([theta.cos(), theta.cos()], -1)[:, None]                # transformers' layout [n, 1, d]
    sin = torch.cat([theta.sin(), theta.sin()], -1)[:, None]
    _check_rope(x, cos, sin, dy, want, g_want)


@needs_native
def test_native_rotary_with_unlike_halves_equals_the_rotate_half_expression():
    """cos and sin whose two halves differ (and sin not the partner of cos): each output and input
    gradient term must take the half the rotate-half expression gives it."""
    g = torch.Generator().manual_seed(5)
    n, heads, d = 6, 3, 48
    x, dy = (torch.randn(n, heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = (torch.randn(n, 1, d, generator=g, dtype=torch.float64) for _ in range(2))
    x64 = x.clone().requires_grad_()
    want = x64 * cos + torch.cat((-x64[..., d // 2:], x64[..., : d // 2]), -1) * sin
    g_want, = torch.autograd.grad((want * dy).sum(), (x64,))
    _check_rope(x, cos, sin, dy, want, g_want)


@needs_native
def test_non_finite_inputs_stay_non_finite():
    x = torch.randn(3, 16)
    x[1, 5] = float("nan")
    y = lo._RMSNorm.apply(x, torch.ones(16), 1e-5, RAW)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    gate = torch.randn(20)
    gate[3], gate[11] = float("nan"), float("inf")
    y = lo._SwiGLU.apply(gate, torch.ones(20), RAW)
    assert torch.isnan(y[3]) and y[11] == float("inf") and torch.isfinite(y[[0, 1, 2, 4]]).all()


def test_other_dtypes_take_pytorchs_operations():
    """float64 (and any non-contiguous input) is computed by PyTorch, bit for bit its result."""
    x = torch.randn(5, 12, dtype=torch.float64)
    w = torch.randn(12, dtype=torch.float64)
    fallback = lambda x, w, eps: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)   # noqa: E731
    assert torch.equal(lo.rms_norm(x, w, 1e-6, fallback), fallback(x, w, 1e-6))
    g, u = torch.randn(4, 6).t(), torch.randn(4, 6).t()              # non-contiguous
    assert torch.equal(lo.swiglu(g, u), torch.nn.functional.silu(g) * u)


@needs_native
def test_lean_forward_through_the_native_layer_ops_equals_the_model_forward(monkeypatch):
    """float32: the same log-probs and gradients as the model's own forward, with every RMSNorm,
    SwiGLU and rotary embedding of the layers going through the native code (none with it off)."""
    assert lo.fns() is not None                          # built and passed its load-time check
    from tests.train.test_forward import _batch, _both_paths, _grads, _model
    tok, model = _model("qwen2", dtype=torch.float32)
    mb = _batch(tok, L=6)
    calls = {"rms": 0, "glu": 0, "rope": 0}
    rms, glu, rope = lo._RMSNorm.apply, lo._SwiGLU.apply, lo._Rope.apply

    def count(kind, fn):
        def f(*a):
            calls[kind] += 1
            return fn(*a)
        return f
    monkeypatch.setattr(lo._RMSNorm, "apply", count("rms", rms))
    monkeypatch.setattr(lo._SwiGLU, "apply", count("glu", glu))
    monkeypatch.setattr(lo._Rope, "apply", count("rope", rope))
    got, want, g_want = _both_paths(model, mb, 0.7)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(_grads(model), g_want, atol=2e-5, rtol=1e-3)
    layers = len(model.model.layers)
    assert calls == {"rms": 2 * layers + 1, "glu": layers, "rope": 2 * layers}
    calls.update(rms=0, glu=0, rope=0)
    monkeypatch.setattr(lean, "NATIVE_LAYER_OPS", False)
    got_off, _, _ = _both_paths(model, mb, 0.7)
    assert calls == {"rms": 0, "glu": 0, "rope": 0}
    torch.testing.assert_close(got_off, got, atol=2e-5, rtol=1e-4)
