"""RMSNorm, the SwiGLU gate and the rotary embedding of the training forward as native code,
forward and backward: grpokit/csrc/layer_ops.c, built and loaded by `grpokit.cbuild`.

PyTorch's RMSNorm forward is one fused operation but its backward is about twenty elementwise
operations, and `silu(g) * u` is two operations forward (keeping SiLU's output for the product's
backward) and three backward. Each is a pass over a [tokens, H] or [tokens, intermediate]
activation. Measured alone at 470 tokens of SmolLM2's shapes on two cores (forward + backward):
RMSNorm 0.47-0.64 ms, SwiGLU 0.8-1.6 ms; a layer runs two RMSNorms and one SwiGLU, so about 0.2 s
of a 3-micro-batch update of 30 layers (docs/performance.md). The rotary embedding in rotate-half form is six
operations forward and as many backward. Here each is one pass forward and one backward, and
SwiGLU keeps only its two inputs for the backward (recomputing the sigmoid there).

Float32 on a CPU with AVX2 and FMA, contiguous rows; anything else (other dtype or device, no
compiler, a failed build or check, GRPOKIT_NATIVE=0) takes PyTorch's operations (`rms_norm`,
`swiglu` and `rope` decide per call). Checked against PyTorch in float64 on first load in a process. The
backward is not itself differentiable (a second derivative through it raises).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from grpokit import cbuild

SOURCE = cbuild.CSRC / "layer_ops.c"
_state: dict = {}


def _bind(lib):
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    rf, rb = lib.grpokit_rms_forward, lib.grpokit_rms_backward
    gf, gb = lib.grpokit_swiglu_forward, lib.grpokit_swiglu_backward
    ro = lib.grpokit_rope
    ro.argtypes = [p, p, p, i64, i64, i64, i32, p, i32]
    ro.restype = None
    rf.argtypes = [p, p, i64, i64, f32, p, p, i32]
    rf.restype = None
    rb.argtypes = [p, p, p, p, i64, i64, p, p, i32]
    rb.restype = i32
    gf.argtypes = [p, p, i64, p, i32]
    gf.restype = None
    gb.argtypes = [p, p, p, i64, p, p, i32]
    gb.restype = None
    if not lib.grpokit_layer_ops_supported():
        raise RuntimeError("this CPU has no AVX2 + FMA")
    return rf, rb, gf, gb, ro, lib


def _p(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class _RMSNorm(torch.autograd.Function):
    """x [n, H], w [H] -> x / rms(x) * w; saves x, w and each row's 1 / rms."""

    @staticmethod
    def forward(ctx, x, w, eps, fns):
        n, H = x.shape
        y, r = torch.empty_like(x), torch.empty(n, dtype=torch.float32)
        fns[0](_p(x), _p(w), n, H, eps, _p(y), _p(r), torch.get_num_threads())
        ctx.save_for_backward(x, w, r)
        ctx.fns = fns
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, r = ctx.saved_tensors
        n, H = x.shape
        dy = dy.contiguous()
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        out = dx if dx is not None else torch.empty_like(x)
        if ctx.fns[1](_p(x), _p(w), _p(r), _p(dy), n, H, _p(out), _p(dw), torch.get_num_threads()):
            raise MemoryError("RMSNorm backward: no scratch memory")
        return dx, dw, None, None


class _SwiGLU(torch.autograd.Function):
    """silu(g) * u elementwise (g, u of one shape); saves g and u."""

    @staticmethod
    def forward(ctx, g, u, fns):
        y = torch.empty_like(g)
        fns[2](_p(g), _p(u), g.numel(), _p(y), torch.get_num_threads())
        ctx.save_for_backward(g, u)
        ctx.fns = fns
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg, du = torch.empty_like(g), torch.empty_like(u)
        ctx.fns[3](_p(g), _p(u), _p(dy.contiguous()), g.numel(), _p(dg), _p(du), torch.get_num_threads())
        return dg, du, None


class _Rope(torch.autograd.Function):
    """x [n, heads, d] rotated by cos, sin [n, d] (rotate-half form); the backward applies the
    transpose of the same rotation."""

    @staticmethod
    def forward(ctx, x, cos, sin, fns):
        n, heads, d = x.shape
        y = torch.empty_like(x)
        fns[4](_p(x), _p(cos), _p(sin), n, heads, d, 0, _p(y), torch.get_num_threads())
        ctx.save_for_backward(cos, sin)
        ctx.fns = fns
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dy = dy.contiguous()
        n, heads, d = dy.shape
        dx = torch.empty_like(dy)
        ctx.fns[4](_p(dy), _p(cos), _p(sin), n, heads, d, 1, _p(dx), torch.get_num_threads())
        return dx, None, None, None


def _rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]


def _rms_reference(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _self_check(fns) -> None:
    with torch.inference_mode(False), torch.enable_grad():     # first use may be under no_grad
        _check(fns)


def _check(fns) -> None:
    """Against PyTorch in float64: RMSNorm at widths with and without a vector tail (rows of very
    different scales), SwiGLU over gates from -90 to 90 (both sigmoid branches, the exponential's
    clamp) and a length with a tail."""
    g = torch.Generator().manual_seed(0)
    for n, H in ((5, 24), (3, 13), (17, 576)):
        x = torch.randn(n, H, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)[:, None]
        w = torch.randn(H, generator=g, dtype=torch.float64)
        dy = torch.randn(n, H, generator=g, dtype=torch.float64)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        want = _rms_reference(xr, wr, 1e-6)
        want_dx, want_dw = torch.autograd.grad((want * dy).sum(), (xr, wr))
        x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
        got = _RMSNorm.apply(x32, w32, 1e-6, fns)
        dx, dw = torch.autograd.grad((got * dy.float()).sum(), (x32, w32))
        for name, a, b in (("output", got, want), ("input gradient", dx, want_dx), ("weight gradient", dw, want_dw)):
            _close("RMSNorm", name, a, b, n, H)
    for n in (4101, 37):
        gate = torch.linspace(-90, 90, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
        up = torch.randn(n, generator=g, dtype=torch.float64)
        dy = torch.randn(n, generator=g, dtype=torch.float64)
        gr, ur = gate.clone().requires_grad_(), up.clone().requires_grad_()
        want = F.silu(gr) * ur
        want_dg, want_du = torch.autograd.grad((want * dy).sum(), (gr, ur))
        g32, u32 = gate.float().requires_grad_(), up.float().requires_grad_()
        got = _SwiGLU.apply(g32, u32, fns)
        dg, du = torch.autograd.grad((got * dy.float()).sum(), (g32, u32))
        for name, a, b in (("output", got, want), ("gate gradient", dg, want_dg), ("up gradient", du, want_du)):
            _close("SwiGLU", name, a, b, n, 1)


    for n, heads, d in ((5, 3, 64), (4, 2, 6)):
        x = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
        ang = torch.randn(n, d, generator=g, dtype=torch.float64)
        cos, sin = ang.cos(), ang.sin() * 1.5                 # halves unlike each other, sin not unit
        dy = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
        xr = x.clone().requires_grad_()
        want = _rope_reference(xr, cos, sin)
        want_dx, = torch.autograd.grad((want * dy).sum(), (xr,))
        x32 = x.float().requires_grad_()
        got = _Rope.apply(x32, cos.float(), sin.float(), fns)
        dx, = torch.autograd.grad((got * dy.float()).sum(), (x32,))
        for name, a, b in (("output", got, want), ("input gradient", dx, want_dx)):
            _close("rotary embedding", name, a, b, n, d)


def _close(what, name, a, b, n, H):
    a = a.detach().double()
    b = b.detach()
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(b.abs().max()))):
        raise RuntimeError(f"layer_ops.c disagrees with PyTorch on the {what} {name} (max error "
                           f"{(a - b).abs().max().item():.3g}, n={n} H={H})")


def fns():
    """The loaded and checked native functions, or None (PyTorch's path), decided once per process."""
    if "fns" not in _state:
        _state["fns"] = cbuild.load("RMSNorm, SwiGLU and rotary", SOURCE, _bind, _self_check)
    return _state["fns"]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, fallback) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight w [H]: native where it serves, else `fallback(x, w, eps)`."""
    if not (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and x.shape[-1] == w.shape[0]
            and x.is_contiguous() and w.is_contiguous()) or (f := fns()) is None:
        return fallback(x, w, eps)
    return _RMSNorm.apply(x.view(-1, x.shape[-1]), w, float(eps), f).view(x.shape)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u: native where it serves, else PyTorch's two operations."""
    if not (g.device.type == "cpu" and g.dtype == u.dtype == torch.float32 and g.shape == u.shape
            and g.is_contiguous() and u.is_contiguous()) or (f := fns()) is None:
        return F.silu(g) * u
    return _SwiGLU.apply(g, u, f)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fallback) -> torch.Tensor:
    """x [n, heads, d] rotated by cos, sin [n, 1, d]: native where it serves, else
    `fallback(x, cos, sin)`. cos and sin need no gradient (positions, not parameters)."""
    if not (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 3
            and x.shape[-1] % 2 == 0 and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
            and x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
            and not (cos.requires_grad or sin.requires_grad)) or (f := fns()) is None:
        return fallback(x, cos, sin)
    return _Rope.apply(x, cos.view(x.shape[0], -1), sin.view(x.shape[0], -1), f)
