"""A lean forward pass for sampling from dense Llama-family decoders (Qwen2, Llama), with a
preallocated KV cache. It reads the transformers model's own weights and computes what its
forward computes (RMSNorm, rotary embeddings, attention with grouped KV heads, SwiGLU MLP), with
about a third of the tensor operations and none of the per-call Python machinery (mask builders,
cache objects, output dataclasses), which is a large share of a decode step of a small model.

`LeanDecoder.supports(model)` says whether a model qualifies (plain `nn.Linear` projections, or peft
LoRA layers over them, default rotary embedding, full attention, SiLU MLP, no logit soft-capping);
the engine falls back to the model's own forward otherwise (quantized layers, DoRA, other
architectures). A LoRA policy decodes with its adapters folded into copies of the weights,
W + scaling * B @ A, made once per call (what `merge` computes, without touching the model): the
same function as peft's forward, which adds the adapter's path to every projection, at the cost of a
dense matmul. Where those copies would take more than half the free memory of the device
(`LeanDecoder.folds_fit`), the engine samples through peft's forward instead.

Deviations from transformers' forward, all within float rounding: the attention projections
(q, k, v) and the MLP's gate and up projections run as one matmul each, on concatenated copies of
their weights made once per `generate` call (laid out for oneDNN where grpokit.gemm chose it); a
decode step's attention is two batched matmuls with the query heads of a KV head side by side
(no KV repeat), which beats the CPU's fused attention kernel at one query per row; RMSNorm uses
`torch.nn.functional.rms_norm` in float32 and float64 (`rms_norm`).

In float32 on the CPU, where the native attention builds (grpokit.rollout.native), a decoding
step's attention runs as one C pass per (row, KV head) instead, and the cache is split (`alloc`):
each prompt's keys and values once, shared by its G rows, and each row's own tokens apart. The
prefill then writes no G copies, a step reads a prompt's keys from memory once for its group, and
rows leaving the batch copy only their own filled columns. Same function, within float rounding
(its softmax uses a polynomial exp, within 2 ulp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpokit import gemm
from grpokit.gemm import linear
from grpokit.rollout import native

_FAMILIES = {"qwen2", "llama"}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as one fused operation in float32 and float64 (transformers normalises in float32
    whatever the dtype, so in float64 this is the more exact of the two); half precision as
    transformers does it: normalise in float32, cast back, then scale."""
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class _Layer:
    ln_in: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln_post: torch.Tensor
    w_gu: torch.Tensor
    b_gu: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None


def lora_parts(mod):
    """(base nn.Linear, [(A, B, scaling) of each active adapter]) of a peft LoRA layer whose
    forward is base(x) + sum scaling * B(A(x)), A and B the adapter's weight parameters; None for
    any other module, or a LoRA layer the lean paths do not reproduce (DoRA, adapter bias, a
    non-Linear base, fan-in-fan-out weights, dropout acting in training mode)."""
    if not (hasattr(mod, "lora_A") and hasattr(mod, "lora_B") and hasattr(mod, "get_base_layer")):
        return None
    base = mod.get_base_layer()
    if type(base) is not torch.nn.Linear or getattr(mod, "fan_in_fan_out", False):
        return None
    if getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False):
        return base, []                         # adapters off, or already inside base.weight
    parts = []
    for ad in mod.active_adapters:
        if ad not in mod.lora_A:
            continue
        A, B = mod.lora_A[ad], mod.lora_B[ad]
        drop = mod.lora_dropout[ad] if hasattr(mod, "lora_dropout") and ad in mod.lora_dropout else None
        if (getattr(mod, "use_dora", {}).get(ad, False) or type(A) is not torch.nn.Linear
                or type(B) is not torch.nn.Linear or B.bias is not None
                or (isinstance(drop, torch.nn.Dropout) and drop.training and drop.p > 0)):
            return None
        parts.append((A.weight, B.weight, mod.scaling[ad]))
    return base, parts


def _wrapped(mod) -> bool:
    """A module replaced by a peft wrapper (`modules_to_save`, an adapter), whose forward is not
    the plain weight the lean paths read."""
    return any(hasattr(mod, a) for a in ("base_layer", "original_module", "modules_to_save"))


def supported_linear(mod) -> bool:
    return type(mod) is torch.nn.Linear or lora_parts(mod) is not None


def _base(mod) -> torch.nn.Linear:
    return mod if type(mod) is torch.nn.Linear else lora_parts(mod)[0]


def _weight(mod) -> torch.Tensor:
    """The weight `mod`'s forward applies: a plain Linear's own, or a LoRA layer's base weight with
    its active adapters folded in (a new tensor, summed in float32 at least; the model is not
    modified)."""
    if type(mod) is torch.nn.Linear:
        return mod.weight
    base, parts = lora_parts(mod)
    w = base.weight
    if not parts:
        return w
    acc = w.float() if w.dtype in (torch.float16, torch.bfloat16) else w
    for A, B, scaling in parts:
        acc = torch.addmm(acc, B.to(acc.dtype), A.to(acc.dtype), alpha=scaling)
    return acc.to(w.dtype)


def _cat_bias(*mods):
    lins = [_base(m) for m in mods]
    if all(lin.bias is None for lin in lins):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in lins])


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: the GPU's free memory, or the host's available
    memory (Linux `MemAvailable`; unknown elsewhere, taken as unlimited)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _unwrap(model):
    """The transformers model under a peft wrapper (its LoRA layers in place), else the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


class LeanDecoder:
    """Prefill + decode for one `generate` call: weights are gathered at construction (so build
    one per call: the policy's weights change between calls), the KV cache is sized per call."""

    @staticmethod
    def supports(model) -> bool:
        model = _unwrap(model)
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _FAMILIES:
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "final_logit_softcapping", None):
            return False
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return False
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            return False
        if type(model.get_output_embeddings()) is not torch.nn.Linear:
            return False
        if type(getattr(inner, "embed_tokens", None)) is not torch.nn.Embedding or _wrapped(inner.norm):
            return False                     # e.g. an adapter or a trainable copy on the embedding
        for layer in inner.layers:
            if _wrapped(layer.input_layernorm) or _wrapped(layer.post_attention_layernorm):
                return False
            a, m = layer.self_attn, layer.mlp
            mods = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
            if not all(supported_linear(x) for x in mods):
                return False
        return True

    @staticmethod
    def folds_fit(model) -> bool:
        """Whether the copies that fold a LoRA policy's adapters into its weights (one per adapted
        projection, alive during a rollout) take at most half the memory free on the model's device.
        LoRA is often chosen to fit a model into memory, so where they do not fit the engine samples
        through the model's own forward, which needs no copies. True for a model without adapters."""
        base = _unwrap(model)
        need = 0
        for mod in base.modules():
            found = lora_parts(mod)
            if found is not None and found[1]:             # a layer with active adapters: one copy
                need += found[0].weight.numel() * found[0].weight.element_size()
        if not need:
            return True
        return need <= free_bytes(next(base.parameters()).device) // 2

    @torch.no_grad()
    def __init__(self, model, rows: int = 64):
        """`rows`: the batch size the weights are laid out for (oneDNN, see grpokit.gemm)."""
        model = _unwrap(model)
        cfg = model.config
        inner = model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        head = model.get_output_embeddings()
        self.w_head, self.b_head = gemm.pack(head.weight, rows), head.bias
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.float()
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight,
                gemm.pack(torch.cat([_weight(a.q_proj), _weight(a.k_proj), _weight(a.v_proj)]), rows),
                _cat_bias(a.q_proj, a.k_proj, a.v_proj),
                gemm.pack(_weight(a.o_proj), rows), _base(a.o_proj).bias, layer.post_attention_layernorm.weight,
                gemm.pack(torch.cat([_weight(m.gate_proj), _weight(m.up_proj)]), rows), _cat_bias(m.gate_proj, m.up_proj),
                gemm.pack(_weight(m.down_proj), rows), _base(m.down_proj).bias))
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.split, self.filled, self.prefix = False, 0, 0

    # ------------------------------------------------------------------ pieces
    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, head_dim] for positions 0..length-1, as transformers computes them."""
        pos = torch.arange(length, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq.to(self.device)[None, :]
        emb = torch.cat((freqs, freqs), -1)
        return ((emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype))

    def alloc(self, rows: int, length: int, *, prompts: int = 0, prefix: int = 0,
              prefix_mask: torch.Tensor | None = None) -> None:
        """A KV cache for `rows` rows of `length` positions. With `prompts` > 0 and `prefix` > 0
        (the rows are `prompts` groups of rows // prompts samples, each group after one prompt of
        `prefix` positions, `prefix_mask` [prompts, prefix] bool marking its real tokens, None: all)
        and the native attention available for this dtype and device (grpokit.rollout.native), the
        prompts' keys and values are kept once per prompt and each row's cache holds only its own
        tokens (`split`): a decoding step reads a prompt's keys once for its group, and the prefill
        writes no copies. Otherwise every row holds its prompt's copy (expanded)."""
        opts = dict(dtype=self.dtype, device=self.device)
        self.split = bool(prompts and prefix and rows % prompts == 0 and rows // prompts > 1
                          and self.device.type == "cpu" and self.dtype == torch.float32
                          and native.attend_fn() is not None)
        self.filled = 0                                                   # columns written in self.k / self.v
        if self.split:
            self.prefix = prefix
            self.kp = [torch.empty(prompts, self.n_kv, prefix, self.head_dim, **opts) for _ in self.layers]
            self.vp = [torch.empty(prompts, self.n_kv, prefix, self.head_dim, **opts) for _ in self.layers]
            self.pmask = None if prefix_mask is None else prefix_mask.to(torch.bool).contiguous()
            self.pid = torch.arange(prompts, device=self.device).repeat_interleave(rows // prompts)
            length -= prefix
        self.k = [torch.empty(rows, self.n_kv, length, self.head_dim, **opts) for _ in self.layers]
        self.v = [torch.empty(rows, self.n_kv, length, self.head_dim, **opts) for _ in self.layers]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these cache rows (finished rows leave the batch), `rows` ascending. The kept
        rows move to the front of the same buffers, their filled columns only."""
        f, m = self.filled, len(rows)
        for c in (self.k, self.v):
            for i, t in enumerate(c):
                if f:
                    t[:m, :, :f] = t[rows, :, :f]
                c[i] = t[:m]
        if self.split:
            self.pid = self.pid[rows]

    def forward(self, ids: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, last_only: bool = True, expand: int = 1) -> torch.Tensor:
        """Run `ids` [n, L] at cache columns start..start+L-1; returns logits [n * expand, V] of the
        last position (`last_only`). cos / sin broadcast to [n, 1, L, head_dim]. `mask`: boolean
        [n, 1, L, start + L] (True = attend) or None (no padding: causal within the new tokens).
        `expand` > 1 (prefill only): the cache rows are the n inputs each repeated `expand` times."""
        n, L = ids.shape
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(ids, self.embed)                                   # [n, L, H]
        half = d // 2
        causal = mask is None and L > 1
        # with the prompts kept apart (`split`), the prefill fills them and a decoding step writes
        # column start - prefix of the rows' own cache; else the rows' cache holds every position
        prefill_split = self.split and expand > 1
        if self.split and not prefill_split and L > 1:
            raise ValueError("a split cache decodes one token per row a step (L = 1)")
        col = start - self.prefix if self.split and not prefill_split else start
        for i, p in enumerate(self.layers):
            h = rms_norm(x, p.ln_in, self.eps)
            qkv = linear(h, p.w_qkv, p.b_qkv).view(n, L, nh + 2 * nkv, d).transpose(1, 2)   # [n, h, L, d]
            qk = qkv[:, :nh + nkv]
            rot = torch.cat((-qk[..., half:], qk[..., :half]), -1)
            qk = torch.addcmul(qk * cos, rot, sin)                         # rotary on q and k at once
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
            kc, vc = self.k[i], self.v[i]
            if prefill_split:                                              # the prompts, once each
                self.kp[i][:, :, start:start + L] = k
                self.vp[i][:, :, start:start + L] = v
                keys, vals = k, v
            elif expand > 1:                                               # one prompt -> its G rows
                kc.view(n, expand, *kc.shape[1:])[:, :, :, col:col + L] = k[:, None]
                vc.view(n, expand, *vc.shape[1:])[:, :, :, col:col + L] = v[:, None]
                keys, vals = k, v
            else:
                kc[:, :, col:col + L] = k
                vc[:, :, col:col + L] = v
                keys, vals = kc[:, :, :col + L], vc[:, :, :col + L]
            if L == 1:      # decode, or the prefill of one-token prompts (expand > 1: keys = k)
                q1, m1 = q.reshape(n, nh, d), None if mask is None else mask[:, 0, 0]        # [n, S]
                if expand > 1:
                    o = native.eager(q1, k, v, 1, m1, self.scale)
                else:
                    pre = (self.kp[i], self.vp[i], self.pmask, self.pid) if self.split else None
                    o = native.attend(q1, kc, vc, col + 1, m1, prefix=pre, scale=self.scale)
                    if o is None:                 # not float32 on the CPU, or the native code is unavailable
                        o = native.eager(q1, kc, vc, col + 1, m1, self.scale, pre)
                o = o.view(n, nh, 1, d)
            else:
                o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, is_causal=causal,
                                                   enable_gqa=nkv != nh)      # [n, nh, L, d]
            x = x + linear(o.transpose(1, 2).reshape(n, L, nh * d), p.w_o, p.b_o)
            h = rms_norm(x, p.ln_post, self.eps)
            g, u = linear(h, p.w_gu, p.b_gu).chunk(2, -1)
            x = x + linear(F.silu(g) * u, p.w_down, p.b_down)
        if not prefill_split:
            self.filled = max(self.filled, col + L)
        if last_only:
            x = x[:, -1]
        logits = linear(rms_norm(x, self.norm, self.eps), self.w_head, self.b_head)
        return logits.repeat_interleave(expand, 0) if expand > 1 else logits
