"""LoRA adapters as a weight update: what a rollout server receives from a LoRA run instead of the
merged model, and how it folds them in.

A LoRA run trains a few million adapter numbers on a frozen base. Sending the merged model after
every step moves the whole base each time (SmolLM2-135M: 513 MiB); sending the adapters moves
r * (in + out) numbers per adapted layer (SmolLM2 at r = 16: 18 MiB). The server then needs the
base: the trainer sends it once (the first sync to that server, as the parts of an update that ends
with the adapters), and the server keeps a copy of each adapted layer's base weight, so every later
update is W = W_base + scale * B @ A, equal bit for bit to peft's merge (a product, a scaling and an
add), so the server's weights equal the trainer's merged export (tested by checksum). Where the
weight and adapters share a dtype, one fused `addmm` per layer is 2.6x faster; whether it rounds
as peft's order does depends on the BLAS (it did on one machine and not on another, by an ulp), so
the first fold of each layer shape computes both and keeps the fused form only where they are equal.

Memory: the server holds a second copy of the adapted layers' weights (the base); the alternative,
running the adapters unmerged during generation, costs two thin matmuls per layer and token.

Tensor names: the adapted layer's Hugging Face module name + `.lora_A` ([r, in]) and `.lora_B`
([out, r]); per layer, the scale (alpha / r) and whether the weight is stored transposed (GPT-2's
Conv1D, peft's `fan_in_fan_out`) travel as metadata (grpokit.rollout.wire.AdapterMeta).
"""

from __future__ import annotations

from typing import Iterable

import torch

SUFFIXES = (".lora_A", ".lora_B")


def tensor_names(module: str) -> tuple[str, str]:
    """The names of a layer's two adapter tensors."""
    return module + SUFFIXES[0], module + SUFFIXES[1]


def check_adapters(given: Iterable[tuple[str, tuple[int, ...]]], specs: dict[str, dict],
                   shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse an adapter update before anything is loaded: the tensors given must be exactly each
    layer's A and B, the layer's weight must exist, and A [r, in] and B [out, r] must fit it.
    ValueError, one line."""
    given = {name: tuple(shape) for name, shape in given}
    expected = {n for m in specs for n in tensor_names(m)}
    if set(given) != expected:
        odd = sorted(set(given) ^ expected)
        raise ValueError(f"an adapter update must hold exactly lora_A and lora_B of each adapted layer; "
                         f"{odd[0]!r} is {'extra' if odd[0] in given else 'missing'}")
    for m, spec in specs.items():
        w = shapes.get(m + ".weight")
        if w is None or len(w) != 2:
            raise ValueError(f"the engine's model has no linear layer {m!r} to take adapters")
        out_f, in_f = (w[1], w[0]) if spec.get("fan_in_fan_out") else w
        a, b = given[m + ".lora_A"], given[m + ".lora_B"]
        if len(a) != 2 or len(b) != 2 or a[1] != in_f or b[0] != out_f or a[0] != b[1]:
            raise ValueError(f"{m}: adapters A {a} and B {b} do not fit its weight {w} (A is [r, in], B is [out, r])")


def lora_delta(A: torch.Tensor, B: torch.Tensor, scale: float, fan_in_fan_out: bool = False,
               fp32: bool = False) -> torch.Tensor:
    """scale * B @ A (transposed for a Conv1D weight), computed as peft's `get_delta_weight` does;
    `fp32`: half-precision adapters go through float32 (peft's linear layer on the CPU)."""
    dtype = B.dtype
    cast = fp32 and dtype in (torch.float16, torch.bfloat16)
    if cast:
        A, B = A.float(), B.float()
    delta = B @ A
    if fan_in_fan_out:
        delta = delta.T
    delta = delta * scale
    return delta.to(dtype) if cast else delta


class AdapterMerger:
    """The base weights of the layers adapters were folded into, and the folding."""

    def __init__(self):
        self.base: dict[str, torch.Tensor] = {}
        self.fused_exact: dict[tuple, bool] = {}     # per (weight shape, rank, dtype): addmm == peft's order

    def forget(self) -> None:
        """The model's weights were replaced: the kept bases are stale."""
        self.base.clear()

    @torch.no_grad()
    def apply(self, state: dict[str, torch.Tensor], named: dict[str, torch.Tensor], specs: dict[str, dict]) -> None:
        """Set each adapted layer's weight in `state` (the model's own tensors) to its base plus the
        adapters' delta. A layer's base is its weight when it first took adapters since `forget`."""
        for m, spec in specs.items():
            w = state[m + ".weight"]
            base = self.base.get(m)
            if base is None:
                base = self.base[m] = w.detach().clone()
            A, B = (named[n].to(w.device) for n in tensor_names(m))
            scale, flip, fp32 = float(spec["scale"]), bool(spec.get("fan_in_fan_out", False)), bool(spec.get("fp32", False))
            key = (tuple(w.shape), A.shape[0], w.dtype)
            if not flip and not fp32 and A.dtype == B.dtype == w.dtype and self.fused_exact.get(key, True):
                torch.addmm(base, B, A, alpha=scale, out=w)      # one pass over the weight, no temporary
                if key in self.fused_exact:
                    continue
                exact = base + lora_delta(A, B, scale, flip, fp32)   # the first of this shape: checked
                self.fused_exact[key] = torch.equal(w, exact)
                if not self.fused_exact[key]:
                    w.copy_(exact)
            else:
                w.copy_(base + lora_delta(A, B, scale, flip, fp32).to(w.dtype))
