"""A decoding step's attention as native code: grpokit/csrc/attend.c, built and loaded by
`grpokit.cbuild` (once per machine, with the system's C compiler, through ctypes).

Why: at one query per row, the eager path's attention is two batched matmuls of tiny matrices
(three query heads against one KV head's cache, per row) plus a scale and a softmax, six operations
and four intermediate tensors a layer; on SmolLM2-135M at 64 rows it was the largest part of what a
decoding step spends beyond its matmuls (docs/performance.md). attend.c does it in one pass per
(row, KV head), reading that row's keys and values once for its query heads.

On first load in a process it is checked against the eager computation on small inputs (grouped
heads, a padding mask, several lengths); any failure (no compiler, a failed build, a mismatch)
leaves the eager path in use, with one logged line. GRPOKIT_NATIVE=0 turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from grpokit import cbuild

SOURCE = cbuild.CSRC / "attend.c"
_state: dict = {}


def _bind(lib):
    fn = lib.grpokit_attend
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, p, i64, i64, p, i64, i64, p, i64,                # q, k, v, mask
                   p, i64, i64, p, i64, i64, p, i64, p, i32,                # the shared prefix
                   p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    fn._lib = lib                                # keep the library loaded while the function lives
    return fn


def eager(q, k, v, S, mask=None, scale=None, prefix=None):
    """The same attention in PyTorch operations (the decoder's path where the native one does not
    serve: no compiler, another dtype or device): q [n, nh, d], k / v [n, nkv, >=S, d], mask
    [n, >=S] bool (True = attend) or None; `prefix` as attend's; out [n, nh, d]. The query heads of
    a KV head side by side in two batched matmuls (no KV repeat), which beats the CPU's fused
    attention kernel at one query per row."""
    n, nh, d = q.shape
    nkv = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    keys, vals = k[:, :, :S], v[:, :, :S]
    if mask is not None:
        mask = mask[:, :S]
    if prefix is not None:
        kp, vp, pmask, pid = prefix
        keys, vals = torch.cat([kp[pid], keys], 2), torch.cat([vp[pid], vals], 2)
        if mask is not None or pmask is not None:
            ones = (lambda m: torch.ones(n, m, dtype=torch.bool, device=q.device))
            mask = torch.cat([pmask[pid] if pmask is not None else ones(kp.shape[2]),
                              mask if mask is not None else ones(S)], 1)
    sc = torch.matmul(q.reshape(n, nkv, nh // nkv, d), keys.transpose(-1, -2)) * scale
    if mask is not None:
        sc = sc.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.matmul(sc.softmax(-1), vals).reshape(n, nh, d)


def _self_check(fn) -> None:
    g = torch.Generator().manual_seed(0)
    for n, nkv, r, d, S, L, masked, P in ((3, 2, 3, 64, 1, 4, False, 0), (5, 3, 3, 64, 37, 40, True, 0),
                                          (4, 1, 4, 32, 9, 9, True, 0), (2, 2, 1, 24, 20, 21, False, 0),
                                          (3, 1, 2, 12, 5, 7, True, 0), (6, 3, 3, 64, 1, 3, False, 11),
                                          (6, 2, 2, 40, 13, 16, True, 7)):
        q = torch.randn(n, nkv * r, d, generator=g)
        k = torch.randn(n, nkv, L, d, generator=g) * 2
        v = torch.randn(n, nkv, L, d, generator=g)
        mask = (torch.rand(n, L, generator=g) > 0.3) if masked else None
        if mask is not None:
            mask[:, S - 1] = True                      # a row's own new token is always there
        prefix = None
        if P:
            B = 3
            pmask = torch.rand(B, P, generator=g) > 0.3 if masked else None
            prefix = (torch.randn(B, nkv, P, d, generator=g), torch.randn(B, nkv, P, d, generator=g), pmask,
                      torch.tensor([2, 0, 0, 1, 2, 1][:n]))
        for threads in (1, 2):
            got = attend(q, k, v, S, mask, prefix=prefix, threads=threads, fn=fn)
            want = eager(q, k, v, S, mask, prefix=prefix)
            if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                err = "no result" if got is None else f"max error {(got - want).abs().max().item():.3g}"
                raise RuntimeError(f"attend.c disagrees with the eager attention ({err}, n={n} nkv={nkv} "
                                   f"r={r} d={d} S={S} P={P} threads={threads})")


def attend_fn():
    """The loaded and checked native function, or None (eager), decided once per process."""
    if "fn" not in _state:
        _state["fn"] = cbuild.load("decode attention", SOURCE, _bind, _self_check)
    return _state["fn"]


def usable(*tensors) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _rows(t, d) -> bool:
    """[rows, heads, length, d] with each position's d values contiguous."""
    return t.dim() == 4 and t.stride(3) == 1 and t.stride(2) == d


def attend(q, k, v, S: int, mask=None, *, prefix=None, scale: float | None = None, threads: int | None = None,
           fn=None, out=None):
    """Single-query attention of q [n, nh, d] over the first S positions of the cache k / v
    [n, nkv, L, d] (grouped heads: nh a multiple of nkv), keys where mask [n, >=S] is False left
    out. `prefix`: (kp, vp, pmask, pid), keys and values shared by several rows (a prompt's, kept
    once for its G samples): row i also attends, before its own S positions, to kp / vp [B, nkv, P, d]
    of prompt pid[i] (int64 [n]), where pmask [B, P] (or None) is True. Float32 on the CPU, each
    position's values contiguous; returns out [n, nh, d], or None when the native code is
    unavailable or these tensors do not suit it (the caller runs eager)."""
    if not usable(q, k, v):
        return None                                    # before any build: another dtype or device
    fn = fn or attend_fn()
    n, nh, d = q.shape
    nkv = k.shape[1]
    if (fn is None or nh % nkv or S < 1 or S > k.shape[2] or q.stride(2) != 1
            or q.stride(1) != d or not _rows(k, d) or not _rows(v, d)):
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 2 or mask.stride(1) != 1 or mask.shape[1] < S):
        return None
    kp = vp = pmask = pid = None
    P = 0
    if prefix is not None:
        kp, vp, pmask, pid = prefix
        P = kp.shape[2]
        if (not usable(kp, vp) or not _rows(kp, d) or not _rows(vp, d) or vp.shape[2] != P
                or pid.dtype != torch.int64 or pid.shape != (n,) or pid.stride(0) != 1
                or (pmask is not None and (pmask.dtype != torch.bool or pmask.stride(1) != 1 or pmask.shape[1] != P))):
            return None
    out = torch.empty(n, nh, d) if out is None else out
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    rc = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
            v.stride(1), ptr(mask), mask.stride(0) if mask is not None else 0,
            ptr(kp), kp.stride(0) if P else 0, kp.stride(1) if P else 0, ptr(vp), vp.stride(0) if P else 0,
            vp.stride(1) if P else 0, ptr(pmask), pmask.stride(0) if pmask is not None else 0, ptr(pid), P,
            out.data_ptr(), n, nkv, nh // nkv, d, S, d ** -0.5 if scale is None else scale,
            torch.get_num_threads() if threads is None else threads)
    return out if rc == 0 else None
