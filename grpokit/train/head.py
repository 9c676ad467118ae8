"""The LM head's log-probabilities of the completion tokens (and their entropy) as one autograd
function over native row kernels (grpokit/csrc/head_logp.c): logits = h W^T, then per row the
log-sum-exp, the target's log-probability and the entropy in one pass, and in backward the
gradient of the logits written over them in one more, followed by the two GEMMs of the head.

PyTorch's own path for the same values (`grpokit.train.logprobs._head_logprobs`: a logsumexp, a
gather and a softmax, and their backward) makes about fifteen passes over the [tokens, vocabulary]
logits; at SmolLM2's 49,152-token vocabulary that was half a second per 512-token micro-batch on
a 2-core machine, as long as the head's three GEMMs themselves (docs/performance.md).

Applies to a plain `nn.Linear` head without bias or hooks, float32 on the CPU, no logit
soft-capping and no differentiable entropy (an entropy bonus): everything else, and any machine where the kernels do
not build or fail their check against PyTorch, takes PyTorch's path (`applies`). The logits are kept
for backward, or recomputed there (`keep_logits=False`, the same trade as activation
checkpointing, for a micro-batch whose logits would exceed the budget).
"""

from __future__ import annotations

import ctypes

import torch

from grpokit import cbuild
from grpokit.gemm import add_grad_t, matmul_t
from grpokit.train.forward import hooked

SOURCE = cbuild.CSRC / "head_logp.c"
_state: dict = {}


def _bind(lib):
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    fwd, bwd = lib.grpokit_logp_forward, lib.grpokit_logp_backward
    fwd.argtypes = [p, i64, i64, i64, p, f32, p, p, p, i32]
    fwd.restype = i64
    bwd.argtypes = [p, i64, i64, i64, p, f32, p, p, i32]
    bwd.restype = None
    fwd._lib = bwd._lib = lib                 # keep the library loaded while the functions live
    return fwd, bwd


def reference(x: torch.Tensor, targets: torch.Tensor, inv_t: float):
    """(logp, lse, entropy) of the rows of logits x [n, V] in PyTorch operations."""
    z = x * inv_t
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    return logp, lse, ent


def _self_check(fns) -> None:
    """Against PyTorch in float64 (more exact than either float32 computation: near-zero entropies
    are a difference of two nearly equal terms in PyTorch's form), on shapes with vector tails, a
    dominant logit, a temperature, a zero gradient, and non-finite logits."""
    with torch.enable_grad():                      # (first use may come under no_grad)
        _check(fns)


def _check(fns) -> None:
    g = torch.Generator().manual_seed(0)
    for n, V, inv_t, spread in ((5, 1003, 1.0, 3.0), (9, 4096, 1 / 0.7, 10.0), (3, 17, 2.0, 30.0), (4, 64, 1.0, 0.0)):
        x = torch.randn(n, V, generator=g) * spread
        x[0, 5] = 60.0                                     # one dominant logit
        t = torch.randint(0, V, (n,), generator=g)
        xr = x.double().requires_grad_(True)
        want = reference(xr, t, inv_t)
        gl = torch.randn(n, generator=g)
        gl[-1] = 0.0                                       # a padding position: zero gradient
        (want[0] * gl.double()).sum().backward()
        got = _stats(fns, x, t, inv_t, True)
        for a, b, what in zip(got, want, ("log-prob", "log-sum-exp", "entropy")):
            if not torch.allclose(a.double(), b.detach(), rtol=1e-5, atol=1e-5):
                raise RuntimeError(f"head_logp.c disagrees with PyTorch on the {what} (max error "
                                   f"{(a - b).abs().max().item():.3g}, n={n} V={V})")
        gx = x.clone()
        _grad_in_place(fns, gx, t, inv_t, got[1], gl)
        if not torch.allclose(gx.double(), xr.grad, rtol=1e-4, atol=1e-6):
            raise RuntimeError(f"head_logp.c disagrees with PyTorch on the gradient (max error "
                               f"{(gx - xr.grad).abs().max().item():.3g}, n={n} V={V})")
    x = torch.randn(3, 40, generator=g)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    got = _stats(fns, x, torch.tensor([1, 2, 3]), 1.0, True)
    if not (torch.isfinite(got[0][0]) and torch.isnan(got[0][1]) and not torch.isfinite(got[0][2])):
        raise RuntimeError("head_logp.c: non-finite logits not handled as PyTorch handles them")


def kernels():
    """The loaded and checked (forward, backward) pair, or None (PyTorch), decided once per process."""
    if "fns" not in _state:
        _state["fns"] = cbuild.load("LM-head log-probs", SOURCE, _bind, _self_check)
    return _state["fns"]


def applies(head, softcap, want_entropy, h: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether `logprobs` computes this head's log-probs (else PyTorch's path)."""
    w = getattr(head, "weight", None)
    if (type(head) is not torch.nn.Linear or head.bias is not None or softcap or want_entropy == "grad"
            or w.dtype != torch.float32 or h.dtype != torch.float32 or w.device.type != "cpu"
            or h.device.type != "cpu" or targets.numel() == 0):
        return False
    if hooked(head):
        return False                               # a hook on the head's forward must see it run
    if int(targets.min()) < 0 or int(targets.max()) >= w.shape[0]:
        return False                               # PyTorch's gather raises its own error
    return kernels() is not None


def _stats(fns, x, targets, inv_t, want_entropy):
    """(logp, lse, entropy or None) of logits x [n, V] (row-contiguous); rows the kernel leaves out
    (a non-finite logit) are computed by PyTorch, so they carry PyTorch's NaN / inf."""
    n, V = x.shape
    t = targets.reshape(-1).to(torch.int64).contiguous()
    logp, lse = torch.empty(n), torch.empty(n)
    ent = torch.empty(n) if want_entropy else None
    bad = fns[0](x.data_ptr(), x.stride(0), n, V, t.data_ptr(), inv_t, logp.data_ptr(), lse.data_ptr(),
                 ent.data_ptr() if ent is not None else None, torch.get_num_threads())
    if bad:
        rows = torch.isnan(lse).nonzero().squeeze(1)
        lp, ls, en = reference(x[rows], t[rows], inv_t)
        logp[rows], lse[rows] = lp, ls
        if ent is not None:
            ent[rows] = en
    return logp, lse, ent


def _grad_in_place(fns, x, targets, inv_t, lse, g):
    t = targets.reshape(-1).to(torch.int64).contiguous()
    g = g.reshape(-1).to(torch.float32).contiguous()
    fns[1](x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], t.data_ptr(), inv_t, lse.contiguous().data_ptr(),
           g.data_ptr(), torch.get_num_threads())


class _HeadLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h2, w, targets, inv_t, want_entropy, keep_logits, fns):
        logits = matmul_t(h2, w)                                   # [n, V]
        logp, lse, ent = _stats(fns, logits, targets, inv_t, want_entropy)
        ctx.save_for_backward(h2, w, targets, lse, logits if keep_logits else None)
        ctx.inv_t, ctx.fns = inv_t, fns
        if ent is None:
            ent = torch.zeros_like(logp)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, _g_ent):
        h2, w, targets, lse, logits = ctx.saved_tensors
        if logits is None or getattr(ctx, "consumed", False):     # (a second backward: overwritten)
            logits = matmul_t(h2, w)                               # recomputed, as checkpointing would
        ctx.consumed = True
        _grad_in_place(ctx.fns, logits, targets, ctx.inv_t, lse, g_logp)   # logits -> d loss / d logits
        gh = matmul_t(logits, w.t(), "grad_input") if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1] and not add_grad_t(w, logits.t(), h2.t(), "head_grad_weight"):
            gw = matmul_t(logits.t(), h2.t(), "head_grad_weight")
        return gh, gw, None, None, None, None, None


def logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
             want_entropy: bool, *, keep_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(target | h) [m, t], entropy [m, t] detached, or zeros) with logits h W^T / temperature,
    h [m, t, H]; differentiable in h and W. Check `applies` first."""
    m, t, H = h.shape
    fns = kernels()
    h2 = h.reshape(m * t, H)
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad):
        with torch.no_grad():
            logp, _, ent = _stats(fns, matmul_t(h2, weight), targets, 1.0 / temperature, want_entropy)
        return logp.view(m, t), (ent if ent is not None else torch.zeros_like(logp)).view(m, t)
    logp, ent = _HeadLogp.apply(h2, weight, targets.reshape(-1), 1.0 / temperature, bool(want_entropy),
                                keep_logits, fns)
    return logp.view(m, t), ent.view(m, t)
