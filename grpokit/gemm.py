"""Float32 matmuls on the CPU through oneDNN, where it beats the BLAS that `torch.nn.functional.linear`
uses.

PyTorch's CPU wheels route float32 `linear` / `matmul` to MKL, whose kernels dispatch on the CPU
vendor: on AMD processors they take the AVX2 path even where the core has full-width AVX-512, and
run at about half of what the hardware does. oneDNN, in the same wheel, dispatches on the
instruction set. Measured on a 2-core AMD EPYC (Zen 5): 80-95 GFLOP/s per core through MKL, 200-220
through oneDNN, for the forward and both backward GEMMs of a linear layer at the sizes grpokit
runs. Both are IEEE float32 GEMMs (no reduced-precision math); they differ by summation order.

What this module offers:
  - `linear(x, w, b)`: `F.linear` with a backward, each of its three GEMMs through the library chosen
    for that GEMM's role;
  - `matmul_t(a, b, role)`: a @ b^T for a custom function's own GEMMs (the LM head's);
  - `pack(w, rows)` / `linear(x, packed, b)`: a weight laid out once for many calls (generation;
    chosen by its own timing at decoding's shapes, `use_packed`);
  - `fast_linears(*models)`: a context in which the models' `nn.Linear` layers use `linear`;
  - `grads_in_place()`: a context in which a weight gradient that would be added to the weight's
    existing `.grad` is added by the GEMM itself (`add_grad_t`), for micro-batch accumulation, and
    `embedding(ids, w)`, whose weight gradient is added into `.grad` row by row there;
  - `choose(mode)`: `auto` (default) times both libraries on this machine for each role and keeps
    oneDNN where it is at least 5% faster; `onednn` / `blas` force one. Env: GRPOKIT_CPU_GEMM.

**Roles** (`ROLES`): a linear layer's forward x w^T, its input gradient g w, its weight gradient
g^T x, and the LM head's weight gradient (logits^T h: tens of thousands of rows from a few hundred
tokens). Each is chosen on its own: the libraries' kernels differ by operand layout, not only by
instruction set. On a 2-core AMD EPYC (Zen 4), at a training micro-batch's shapes (300-560 tokens,
SmolLM2's projections, two threads, best of 15 alternated rounds), oneDNN ran the forward GEMMs at
185-204 GFLOP/s against 147-194 through MKL and the input gradients at 205-223 against 160-192, but
the head's weight gradient at 112-124 against 146-160; the layers' weight gradients went either way
by shape. One choice for all three (the rule before 2026-12-07, on a forward GEMM alone with a 15%
margin) kept MKL for everything there, where the training forward and update took 1.13-1.14x as
long as with a choice per role (docs/performance.md).

The `auto` choices are timed once per machine, not per process, and kept in
`$GRPOKIT_CACHE/gemm/` (named by the CPU and the torch version): two GEMMs differ in summation
order, so a choice timed again by every process would, on a loaded machine, let a rollout server and
the trainer's ranks, or two runs of one seed, round differently.

Only float32 tensors on the CPU are affected; everything else goes to `F.linear` unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from grpokit.cache import cache_dir, cpu_id

log = logging.getLogger(__name__)

_state: dict = {"mode": os.environ.get("GRPOKIT_CPU_GEMM", "auto"), "use": {}, "packed": None}
_backward = threading.local()      # `grads_in_place` per thread (a CPU backward runs on its caller's)

# role -> the name its choice is kept under (the module's docstring says what each computes)
ROLES = {"forward": "onednn_forward", "grad_input": "onednn_grad_input", "grad_weight": "onednn_grad_weight",
         "head_grad_weight": "onednn_head_grad_weight"}
LINEAR_ROLES = ("forward", "grad_input", "grad_weight")     # the three GEMMs of `linear`
MARGIN = 1.05     # oneDNN is kept for a role where it is at least this much faster


def _op():
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def available() -> bool:
    return torch.backends.mkldnn.is_available() and _op() is not None


def choose(mode: str = "auto") -> None:
    """Set the policy: `auto` (time both once), `onednn` or `blas`."""
    if mode not in ("auto", "onednn", "blas"):
        raise ValueError(f"cpu gemm mode must be auto, onednn or blas, not {mode!r}")
    _state["mode"], _state["use"], _state["packed"] = mode, {}, None


def _race(a, b, rounds: int = 7) -> tuple[float, float]:
    """Best wall time of `a` and of `b`, each warmed up, then timed in alternation (a b a b ...), so
    warm-up effects and a burst of other load on the machine fall on both."""
    for fn in (a, b, a, b):
        fn()
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for k, fn in enumerate((a, b)):
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    return best[0], best[1]


def _role_operands(role: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(a, b) pairs for a @ b^T as `role` lays them out, at a training micro-batch's sizes: 512 tokens
    through a 512 -> 1536 and a 1536 -> 512 projection (the head: a 32,768-token vocabulary, 256
    tokens, 512 wide)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)        # noqa: E731
    if role == "head_grad_weight":
        return [(r(256, 32768).t(), r(256, 512).t())]
    pairs = []
    for n_in, n_out in ((512, 1536), (1536, 512)):
        x, w, gy = r(512, n_in), r(n_out, n_in), r(512, n_out)
        pairs.append({"forward": (x, w), "grad_input": (gy, w.t()), "grad_weight": (gy.t(), x.t())}[role])
    return pairs


def _time_role(role: str) -> bool:
    """Whether oneDNN beats the BLAS by `MARGIN` at `role`'s GEMMs (their summed best times)."""
    try:
        op, pairs = _op(), _role_operands(role)
        blas, dnn = _race(lambda: [F.linear(a, b) for a, b in pairs],
                          lambda: [op(a, b, None, "none", [], "") for a, b in pairs])
        return dnn * MARGIN < blas
    except RuntimeError:
        return False


def _time_packed() -> bool:
    try:
        x, w = torch.randn(64, 576), torch.randn(1536, 576)
        op, packed = _op(), torch.ops.mkldnn._reorder_linear_weight(w, 64)
        blas, dnn = _race(lambda: F.linear(x, w), lambda: op(x, packed, None, "none", [], ""))
        return dnn < blas
    except RuntimeError:
        return False


def _machine_choice(name: str, timed) -> bool:
    """This machine's kept answer to `name`, or `timed()` run now and kept. The file is read and
    written under a lock, so processes starting together (a launcher's ranks, a server) take one
    answer; where the cache cannot be written, the process times for itself."""
    key = hashlib.sha256((cpu_id() + torch.__version__).encode()).hexdigest()[:16]
    path = cache_dir("gemm") / f"choice-{key}.json"
    try:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                kept = json.loads(path.read_text())
                kept = kept if isinstance(kept, dict) else {}
            except (OSError, ValueError):
                kept = {}
            if not isinstance(kept.get(name), bool):
                kept[name] = bool(timed())
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(kept))
                os.replace(tmp, path)
                log.info("cpu gemm: %s = %s, timed on this machine and kept in %s (GRPOKIT_CPU_GEMM=onednn|blas "
                         "forces one)", name, kept[name], path)
            return kept[name]
    except (OSError, ImportError) as e:
        log.warning("cpu gemm: the choice cannot be kept (%s); timed by this process alone", e)
        return bool(timed())


def uses(role: str) -> bool:
    """Whether float32 CPU GEMMs of `role` (`ROLES`) go through oneDNN (each decided once per
    machine, `_machine_choice`)."""
    if role not in _state["use"]:
        mode = _state["mode"]
        if mode == "blas" or not available():
            _state["use"][role] = False
        elif mode == "onednn":
            _state["use"][role] = True
        else:
            _state["use"][role] = _machine_choice(ROLES[role], lambda: _time_role(role))
    return _state["use"][role]


def use_onednn() -> bool:
    """Whether linears take `linear` (some GEMM of theirs goes through oneDNN) rather than `F.linear`."""
    return any(uses(role) for role in LINEAR_ROLES)


def use_packed() -> bool:
    """Whether `pack` lays weights out for oneDNN (decided once per machine, separately from
    `use_onednn`). Decoding multiplies a few dozen rows by every weight, a shape where oneDNN with
    a weight packed for that row count beats the BLAS even on processors where the BLAS wins the
    square GEMMs that `use_onednn` times: on a Zen 3 core, 64 rows by SmolLM2's projections ran at
    90-99 GFLOP/s packed against 54-88 through MKL."""
    if _state["packed"] is None:
        mode = _state["mode"]
        if mode == "blas" or not available():
            _state["packed"] = False
        elif mode == "onednn":
            _state["packed"] = True
        else:
            _state["packed"] = _machine_choice("onednn_packed_decode", _time_packed)
    return _state["packed"]


def _eligible(*ts) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in ts)


def _mm_t(a: torch.Tensor, b: torch.Tensor, role: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b^T (+ bias) for 2-D a [M, K], b [N, K] (either may be a transposed view), through the
    library chosen for `role`."""
    if uses(role):
        return _op()(a, b, bias, "none", [], "")
    return F.linear(a, b, bias)


class _OneDNNLinear(torch.autograd.Function):
    """y = x w^T + b with each of the three GEMMs (forward, grad x, grad w) through its role's choice."""

    @staticmethod
    def forward(ctx, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])                                   # [M, K]
        y = _mm_t(x2, w, "forward", b)                                    # [M, N]
        ctx.save_for_backward(x2, w)
        ctx.in_shape, ctx.has_b = x.shape, b is not None
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])                                 # [M, N]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _mm_t(g2, w.t(), "grad_input").view(ctx.in_shape)        # [M, K] = g w
        if ctx.needs_input_grad[1] and not add_grad_t(w, g2.t(), x2.t(), "grad_weight"):
            gw = _mm_t(g2.t(), x2.t(), "grad_weight")                     # [N, K] = g^T x
        if ctx.has_b and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


@contextmanager
def grads_in_place():
    """Within the block (a `backward()` that accumulates into `.grad`, as micro-batches do), a weight
    gradient computed by `linear` or the LM head is added into the weight's existing `.grad` by its
    GEMM (beta = 1, `add_grad_t`), and an `embedding`'s row by row, instead of returned to autograd,
    which would write it to a fresh buffer and then add that buffer to `.grad`: one pass over every
    weight's gradient and its allocation saved per micro-batch after the first. Only for backward
    passes whose gradients nothing but `.grad` receives: not under data-parallel wrappers (DDP,
    FSDP2), whose hooks on the weights' gradient accumulation would not run, and which
    `add_grad_t` cannot see."""
    was = getattr(_backward, "in_place", False)
    _backward.in_place = True
    try:
        yield
    finally:
        _backward.in_place = was


def _grad_to_add_into(w: torch.Tensor, *like: torch.Tensor) -> torch.Tensor | None:
    """w's `.grad`, where adding w's gradient into it in place is the same result as returning the
    gradient to autograd: within `grads_in_place`, not building a graph of the gradient
    (`create_graph`), w a plain leaf tensor with no gradient hooks, its `.grad` a dense contiguous
    tensor already there, of the dtype and device of the operands `like`. Otherwise None."""
    if (not getattr(_backward, "in_place", False) or type(w) not in (torch.Tensor, torch.nn.Parameter)
            or torch.is_grad_enabled()):          # (grad mode on in backward: create_graph)
        return None
    g = w.grad
    if (g is None or w.grad_fn is not None or g.layout != torch.strided or g.shape != w.shape
            or not g.is_contiguous() or any(t.dtype != g.dtype or t.device != g.device for t in like)
            or w._backward_hooks or getattr(w, "_post_accumulate_grad_hooks", None)):
        return None
    return g


def add_grad_t(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, role: str) -> bool:
    """`w.grad += a @ b^T` in one GEMM, and True, where that is the same result as returning a @ b^T
    as w's gradient (`_grad_to_add_into`) and the GEMM for `role` is PyTorch's own (`addmm_` takes
    beta = 1; the oneDNN call `_mm_t` uses does not). Otherwise False: the caller returns the gradient."""
    g = _grad_to_add_into(w, a, b)
    if g is None or (_eligible(a, b) and uses(role)):
        return False
    g.addmm_(a, b.t())
    return True


class _Embedding(torch.autograd.Function):
    """`F.embedding(ids, w)` whose weight gradient, under `grads_in_place`, is added into w's `.grad`
    row by row (`index_add_`) where autograd would build a dense [vocabulary, hidden] gradient (a
    fresh zero-filled buffer, 113 MB for SmolLM2's 49,152 x 576, 545 MB for a 151,936 x 896
    vocabulary) and then add it to `.grad`: both passes, and the buffer's page faults, per micro-batch."""

    @staticmethod
    def forward(ctx, ids, w):
        ctx.save_for_backward(ids, w)
        return F.embedding(ids, w)

    @staticmethod
    def backward(ctx, gy):
        ids, w = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None
        flat, g2 = ids.reshape(-1), gy.reshape(-1, gy.shape[-1])
        # on the CPU `index_add_` sums an id's rows in order (deterministic); CUDA's uses atomics
        g = _grad_to_add_into(w, g2) if g2.device.type == "cpu" else None
        if g is not None:
            g.index_add_(0, flat, g2)
            return None, None
        return None, torch.ops.aten.embedding_dense_backward(g2, flat, w.shape[0], -1, False)


def embedding(ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, w)` (no padding index, dense gradient), its weight gradient added into
    `.grad` in place under `grads_in_place` (`_Embedding`)."""
    if torch.is_grad_enabled() and w.requires_grad:
        return _Embedding.apply(ids, w)
    return F.embedding(ids, w)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)`, its GEMMs through oneDNN for float32 CPU tensors where chosen (`uses`).
    `w` may be a weight from `pack` (then no gradient flows to it)."""
    if w.layout == torch._mkldnn:
        return _op()(x, w, b, "none", [], "")
    if not (_eligible(x, w, b) and use_onednn()):
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _OneDNNLinear.apply(x, w, b)
    return _mm_t(x.reshape(-1, x.shape[-1]), w, "forward", b).view(*x.shape[:-1], w.shape[0])


def matmul_t(a: torch.Tensor, b: torch.Tensor, role: str = "forward") -> torch.Tensor:
    """a @ b^T for 2-D a [M, K] and b [N, K] (either may be a transposed view), through oneDNN for
    float32 CPU tensors where chosen for `role`; no autograd (for the backward of a custom function)."""
    return _mm_t(a, b, role) if _eligible(a, b) else F.linear(a, b)


def pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """`w` laid out for oneDNN, for `rows`-row inputs (others work too); `w` itself when packing
    is not chosen (`use_packed`). Inference only: a packed weight has no gradient."""
    if not (_eligible(w) and use_packed()):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), max(int(rows), 1))


def _forward(self, x):
    return linear(x, self.weight, self.bias)


@contextmanager
def fast_linears(*models):
    """Within the block, the `nn.Linear` layers of `models` (float32, CPU) compute through `linear`.
    A no-op when oneDNN is not chosen, and for a model with gradient checkpointing on (its layers
    are recomputed during backward, outside the block: the recomputation must take the same path)."""
    patched = []
    if use_onednn():
        for model in models:
            if model is None or getattr(model, "is_gradient_checkpointing", False):
                continue
            for mod in model.modules():
                if type(mod) is torch.nn.Linear and "forward" not in mod.__dict__ and _eligible(mod.weight):
                    mod.forward = types.MethodType(_forward, mod)
                    patched.append(mod)
    try:
        yield
    finally:
        for mod in patched:
            mod.__dict__.pop("forward", None)
