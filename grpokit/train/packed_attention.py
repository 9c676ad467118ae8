"""The training forward's attention as native code over the packed tokens: grpokit/csrc/
packed_attend.c, forward and backward, built and loaded by `grpokit.cbuild`.

`grpokit.train.forward` packs a micro-batch's real tokens (each distinct prompt once, then each
row's completion tokens) and, on PyTorch's path, scatters them into padded layouts for
`scaled_dot_product_attention`: the prompts' [u, P], and buckets of completion rows, each row
with its prompt's keys copied in front of its own. Attention was then about 1.6 s of an
EOS-ignored update of SmolLM2-135M on two cores and 0.6-0.9 s of an EOS one (docs/performance.md):
the calls, the scatter and gather, the copies, and the padded (query, key) pairs. Here each token
attends from the packed tensors themselves to its prompt's keys and, causally, to its own
sequence's: no padding, no copies, no masks. The backward recomputes the probabilities from the
forward's log-sum-exp, as flash attention does (Dao et al. 2022).

Float32 on a CPU with AVX2 and FMA only; checked against a dense attention in PyTorch operations
(float64) on first load in a process (any failure leaves PyTorch's path in use, with one logged
line). GRPOKIT_NATIVE=0 turns it off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from grpokit import cbuild

SOURCE = cbuild.CSRC / "packed_attend.c"
_state: dict = {}


@dataclass
class Plan:
    """Which keys each packed token attends to (int64 [N] each): [a0, a1) (its prompt's tokens, for
    a completion token) and [b0, t] (its own sequence's, causally); for the backward, `e` the end of
    each token's own sequence, `u` its prompt's index for a prompt token (-1 otherwise), and the
    completion rows of prompt u as token ranges rows[rs[u]:rs[u + 1]] ([n, 2] start, end)."""
    a0: torch.Tensor
    a1: torch.Tensor
    b0: torch.Tensor
    e: torch.Tensor
    u: torch.Tensor
    rs: torch.Tensor
    rows: torch.Tensor
    segs: torch.Tensor               # [n, 2] start, end of every sequence (prompts, then rows)
    _tiles: dict = None

    def tiles(self, per: int) -> torch.Tensor:
        """[n, 2] start, count: each sequence cut into runs of at most `per` tokens."""
        if self._tiles is None:
            self._tiles = {}
        if per not in self._tiles:
            out = [(a, min(per, b - a)) for a, b in self.segs.tolist() for a in range(a, b, per)]
            self._tiles[per] = torch.tensor(out, dtype=torch.long).reshape(-1, 2).contiguous()
        return self._tiles[per]


def plan(p_att: torch.Tensor, c_att: torch.Tensor, inv: torch.Tensor) -> Plan:
    """The plan of the packed layout `grpokit.train.forward` uses: p_att [u, P] the distinct
    prompts' real tokens, c_att [m, Lc] each row's completion tokens fed, inv [m] each row's prompt."""
    p_att, c_att, inv = p_att.cpu(), c_att.cpu(), inv.cpu()
    pn = p_att.sum(1)                                     # real tokens per prompt
    cn = c_att.sum(1)
    ps = torch.cumsum(pn, 0) - pn
    pe = ps + pn
    Np = int(pn.sum())
    cs = Np + torch.cumsum(cn, 0) - cn
    ce = cs + cn
    u = p_att.shape[0]
    pid_tok = torch.repeat_interleave(torch.arange(u), pn)
    row_tok = torch.repeat_interleave(torch.arange(c_att.shape[0]), cn)
    zeros = torch.zeros(Np, dtype=torch.long)
    a0 = torch.cat([zeros, ps[inv][row_tok]])
    a1 = torch.cat([zeros, pe[inv][row_tok]])
    b0 = torch.cat([ps[pid_tok], cs[row_tok]])
    e = torch.cat([pe[pid_tok], ce[row_tok]])
    uu = torch.cat([pid_tok, torch.full((int(cn.sum()),), -1, dtype=torch.long)])
    live = cn > 0
    order = torch.argsort(inv[live], stable=True)
    rows = torch.stack([cs[live][order], ce[live][order]], 1).contiguous()
    counts = torch.bincount(inv[live], minlength=u)
    rs = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    segs = torch.cat([torch.stack([ps, pe], 1), torch.stack([cs[live], ce[live]], 1)])
    return Plan(*(t.contiguous() for t in (a0, a1, b0, e, uu, rs, rows, segs)))


def _bind(lib):
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    fwd, bwd = lib.grpokit_packed_forward, lib.grpokit_packed_backward
    fwd.argtypes = [p, p, p, p, p, p, p, i64, i64, i32, i32, i32, f32, p, p, i32]
    bwd.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, i64, i64, i32, i32, i32, f32, p, p, p, i32]
    fwd.restype = bwd.restype = i32
    if not lib.grpokit_packed_supported():
        raise RuntimeError("this CPU has no AVX2 + FMA")
    return fwd, bwd, lib


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """[N, nkv, d] -> [nkv, d, N + 8], 8 zero columns past the last token (the kernel reads keys 8 at a time)."""
    N, nkv, d = x.shape
    out = x.new_zeros(nkv, d, N + 8)
    out[:, :, :N] = x.permute(1, 2, 0)
    return out


QT = 12   # (query, head) pairs in a tile (packed_attend.c)


class _Attention(torch.autograd.Function):
    """q [N, nh, d], k / v [N, nkv, d] -> [N, nh, d]; saves the log-sum-exp for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, pl, scale, fns):
        N, nh, d = q.shape
        nkv = k.shape[1]
        r = nh // nkv
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kt = _transposed(k)
        qt = pl.tiles(max(1, QT // r))
        out = torch.empty_like(q)
        lse = torch.empty(N, nh, dtype=torch.float32)
        if fns[0](_ptr(q), _ptr(v), _ptr(kt), _ptr(pl.a0), _ptr(pl.a1), _ptr(pl.b0), _ptr(qt), qt.shape[0],
                  N, nkv, r, d, scale, _ptr(out), _ptr(lse), torch.get_num_threads()):
            raise MemoryError("packed attention: no scratch memory")
        ctx.save_for_backward(q, k, v, kt, out, lse)
        ctx.pl, ctx.scale, ctx.fns = pl, scale, fns
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, kt, out, lse = ctx.saved_tensors
        pl = ctx.pl
        N, nh, d = q.shape
        nkv = k.shape[1]
        r = nh // nkv
        do = do.contiguous()
        D = (do * out).sum(-1).contiguous()
        vt = _transposed(v)
        kk = pl.tiles(8)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if ctx.fns[1](_ptr(q), _ptr(k), _ptr(kt), _ptr(vt), _ptr(do), _ptr(lse), _ptr(D),
                      _ptr(pl.e), _ptr(pl.u), _ptr(pl.rs), _ptr(pl.rows), _ptr(kk), kk.shape[0], N, nkv, r, d,
                      ctx.scale, _ptr(dq), _ptr(dk), _ptr(dv), torch.get_num_threads()):
            raise MemoryError("packed attention: no scratch memory")
        return dq, dk, dv, None, None, None


def reference(q, k, v, pl: Plan, scale: float) -> torch.Tensor:
    """The same attention in PyTorch operations, with a dense [N, N] mask (for checks)."""
    N, nh, d = q.shape
    t = torch.arange(N)
    j = t[None]
    mask = ((j >= pl.a0[:, None]) & (j < pl.a1[:, None])) | ((j >= pl.b0[:, None]) & (j <= t[:, None]))
    rep = torch.arange(nh) // (nh // k.shape[1])
    s = torch.einsum("thc,jhc->htj", q, k[:, rep]) * scale
    p = s.masked_fill(~mask[None], float("-inf")).softmax(-1)
    return torch.einsum("htj,jhc->thc", p, v[:, rep])


def _self_check(fns) -> None:
    with torch.inference_mode(False), torch.enable_grad():     # first use may be under no_grad
        _check(fns)


def _check(fns) -> None:
    g = torch.Generator().manual_seed(0)
    for nkv, r, d, prompts, rows in ((1, 1, 8, [3], [(0, 2), (0, 0)]), (2, 3, 64, [5, 2], [(0, 4), (1, 3), (0, 1), (1, 5)]),
                                     (3, 2, 24, [1, 4, 2], [(2, 3), (0, 2), (1, 6), (2, 2), (0, 1)]),
                                     (1, 7, 16, [13, 9], [(0, 21), (1, 17), (0, 3), (1, 30)]),
                                     (3, 3, 64, [50, 48], [(i // 4, 3 + 7 * i) for i in range(8)])):
        p_att = torch.zeros(len(prompts), max(prompts), dtype=torch.bool)
        for i, n in enumerate(prompts):
            p_att[i, -n:] = True
        L = max(n for _, n in rows)
        c_att = torch.arange(L)[None] < torch.tensor([n for _, n in rows])[:, None]
        pl = plan(p_att, c_att, torch.tensor([u for u, _ in rows]))
        N = int(p_att.sum() + c_att.sum())
        q = torch.randn(N, nkv * r, d, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(N, nkv, d, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(N, nkv, d, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(N, nkv * r, d, generator=g, dtype=torch.float64)
        want = reference(q, k, v, pl, d ** -0.5)
        gw = torch.autograd.grad((want * w).sum(), (q, k, v))
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        got = _Attention.apply(q32, k32, v32, pl, d ** -0.5, fns)
        gg = torch.autograd.grad((got * w.float()).sum(), (q32, k32, v32))
        for name, a, b in (("output", got, want), *zip(("dq", "dk", "dv"), gg, gw)):
            if not torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"packed_attend.c disagrees with PyTorch's attention ({name}: max error "
                                   f"{(a.double() - b).abs().max().item():.3g}, nkv={nkv} r={r} d={d})")


def fns():
    """The loaded and checked native functions, or None (PyTorch's path), decided once per process."""
    if "fns" not in _state:
        _state["fns"] = cbuild.load("training attention", SOURCE, _bind, _self_check)
    return _state["fns"]


def usable(device, dtype) -> bool:
    """Whether the native attention serves tensors of this device and dtype (building it on first use)."""
    return device.type == "cpu" and dtype == torch.float32 and fns() is not None


def attend(q, k, v, pl: Plan, scale: float | None = None) -> torch.Tensor | None:
    """Attention of the packed tokens q [N, nh, d], k / v [N, nkv, d] as `pl` says -> [N, nh * d],
    or None where the native code does not serve (not float32 on the CPU, unavailable)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k, v)):
        return None
    f = fns()
    if f is None or q.shape[1] % k.shape[1]:
        return None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Attention.apply(q, k, v, pl, scale, f).view(q.shape[0], -1)
