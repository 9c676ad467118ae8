"""The sampler's plain path as native code: grpokit/csrc/sample.c, built and loaded by
`grpokit.cbuild` (once per machine, with the system's C compiler, through ctypes).

`grpokit.rollout.base.sample_next` draws through it when sampling is at a temperature with no
top-k, no top-p and no over-confidence resampling (the default), on float32 CPU logits: one
kernel does the temperature, the softmax's sums and the inverse transform draw at the same
quantiles the PyTorch path uses (the same random numbers, drawn the same way), with its cumulative
sums in double. The distribution is the same; a token can differ from PyTorch's only where a
quantile falls within float rounding of a boundary between two tokens. For SmolLM2-135M's logits
at 64 rows it takes 2.2 ms at two threads and 2.9 ms at one, against 5.9 and 10.9 ms for PyTorch's
path (docs/performance.md).

On first load in a process it is checked against float64 PyTorch on small inputs (ragged vector
tails, masked tokens, a dominant logit, several temperatures, quantiles at 0 and just below 1, a
row with no distribution, one and two threads); any failure (no compiler, a failed build, a
mismatch) leaves PyTorch's path in use, with one logged line. GRPOKIT_NATIVE=0 turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from grpokit import cbuild

SOURCE = cbuild.CSRC / "sample.c"
_state: dict = {}


def _bind(lib):
    fn = lib.grpokit_sample
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, ctypes.c_float, p, p, p, ctypes.c_int]
    fn.restype = i64
    fn._lib = lib                                # keep the library loaded while the function lives
    return fn


def _reference(x: torch.Tensor, inv_t: float, u: torch.Tensor):
    """float64 masses, their cumulative sum and each row's target u * total."""
    p = torch.softmax(x.double() * inv_t, -1)
    cdf = p.cumsum(-1)
    return p, cdf, u * cdf[:, -1]


def _self_check(fn) -> None:
    g = torch.Generator().manual_seed(0)
    below_one = float(torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))
    for n, V, inv_t, spread in ((7, 1003, 1.0, 3.0), (5, 4096, 1 / 0.7, 8.0), (6, 2050, 1.25, 1.0), (4, 13, 2.0, 20.0)):
        x = torch.randn(n, V, generator=g) * spread
        x[0, V // 3] = 50.0                                     # a dominant logit
        x[1, ::3] = float("-inf")                               # masked tokens
        x[2, : V // 2] = float("-inf")                          # whole masked blocks
        u = torch.rand(n, dtype=torch.float64, generator=g)
        u[-1], u[-2] = 0.0, below_one
        p, cdf, target = _reference(x, inv_t, u)
        runs = [sample(x, inv_t, u, threads=t, fn=fn) for t in (1, 2)]
        if any(r is None for r in runs):
            raise RuntimeError(f"sample.c gave no result (n={n} V={V})")
        (tok, lp, _), (tok2, lp2, _) = runs
        if not (torch.equal(tok, tok2) and torch.equal(lp, lp2)):
            raise RuntimeError(f"sample.c differs between one and two threads (n={n} V={V})")
        for i in range(n):
            t = int(tok[i])
            lo = float(cdf[i, t - 1]) if t > 0 else 0.0
            slack = 1e-6 * float(cdf[i, -1])
            # the token's interval [lo, cdf_t) holds the target, up to rounding, and it has mass
            if not (0 <= t < V and p[i, t] > 0 and lo - slack <= target[i] <= float(cdf[i, t]) + slack):
                raise RuntimeError(f"sample.c drew token {t} outside the quantile's interval (row {i}, V={V})")
            if abs(float(lp[i]) - float(p[i, t].log())) > 1e-5 * max(1.0, abs(float(p[i, t].log()))):
                raise RuntimeError(f"sample.c's log-prob {float(lp[i]):.6g} != {float(p[i, t].log()):.6g} (V={V})")
    bad = torch.randn(3, 40, generator=g)
    bad[0, 7], bad[2] = float("nan"), float("-inf")
    bad[1, 3] = float("inf")
    tok, _, n_bad = sample(bad, 1.0, torch.zeros(3, dtype=torch.float64), fn=fn)
    if tok.tolist() != [-1, -1, -1] or n_bad != 3:
        raise RuntimeError(f"sample.c drew {tok.tolist()} ({n_bad} counted) from rows without a distribution")


def sample_fn():
    """The loaded and checked native function, or None (PyTorch), decided once per process."""
    if "fn" not in _state:
        _state["fn"] = cbuild.load("sampling", SOURCE, _bind, _self_check)
    return _state["fn"]


def suits(logits: torch.Tensor) -> bool:
    """Logits the kernel takes: float32 [n, V] on the CPU, each row contiguous."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1)


def sample(logits: torch.Tensor, inv_t: float, u: torch.Tensor, *, threads: int | None = None, fn=None):
    """(tokens int64 [n], log-probs float32 [n], rows without a distribution) drawn from
    softmax(logits * inv_t) at quantiles u [n] (float64 in [0, 1)), or None where the native code is
    unavailable, the logits do not `suit` it, or it declined a row (its largest logit * inv_t at 2^20
    or more): the caller runs PyTorch's path. A row with no distribution (NaN, +inf, or all -inf)
    gets token -1."""
    if not suits(logits):
        return None
    fn = fn or sample_fn()
    if fn is None or not inv_t > 0:
        return None
    n, V = logits.shape
    u = u.to(device="cpu", dtype=torch.float64).contiguous()
    tok = torch.empty(n, dtype=torch.int64)
    lp = torch.empty(n, dtype=torch.float32)
    bad = fn(logits.data_ptr(), logits.stride(0), n, V, float(inv_t), u.data_ptr(), tok.data_ptr(), lp.data_ptr(),
             torch.get_num_threads() if threads is None else threads)
    return None if bad < 0 else (tok, lp, int(bad))
