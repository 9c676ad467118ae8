"""A lean training forward for dense Llama-family decoders (Qwen2, Llama), with each distinct prompt
of a micro-batch computed once.

`completion_logprobs` needs, for every completion token, the hidden state that predicts it. The
model's own forward gets them by running prompt + completion for every row: with G completions per
prompt the prompt runs G times, and every layer pays transformers' generic machinery (a mask
builder, RMSNorm as five operations, rotary as seven per tensor, repeated KV heads). This forward
computes the same function with the model's own parameters (so autograd reaches them as usual):

- the distinct prompts of the micro-batch run once; each completion attends to its prompt's keys
  and values, gathered by row (a differentiable index, so the prompt's gradient is the sum over
  its completions) -- the prompt is shared by the group in training as in sampling;
- prompt and completion tokens go through each projection as one matrix (one GEMM per weight),
  and padding does not: short prompts' left padding and the right padding of completions that
  ended early are left out of the matrix (the real tokens packed), and placed back, as zeros, only
  for attention's padded layout -- with EOS, a group's rows end far apart, and its padding was
  half of what the projections multiplied;
- RMSNorm is `torch.nn.functional.rms_norm`, rotary one expression per tensor, attention
  `scaled_dot_product_attention` with grouped KV heads and an explicit boolean mask.

Results equal the model's forward up to float summation order (tests/train/test_forward.py checks
log-probs and gradients against it). `supports(model)` says when this path applies; otherwise
(quantized layers, DoRA, other architectures, gradient checkpointing, attention or LoRA dropout in
training mode, forward hooks on the decoder such as reference dropout's) the caller runs the
model's own forward. peft LoRA layers are computed as peft computes them, base(x) + scaling *
B(A(x)) with the adapters' own parameters, so the gradients reach the adapters.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from grpokit.gemm import linear
from grpokit.rollout.decoder import LeanDecoder, lora_parts
from grpokit.rollout.decoder import rms_norm as _rms

_enabled = True


@contextlib.contextmanager
def disabled():
    """Run the model's own forward everywhere within (to compare the two paths bit for bit)."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


def supports(model) -> bool:
    """Whether `prompt_shared_states` computes this (unwrapped) model's forward."""
    if not _enabled or not LeanDecoder.supports(model):
        return False
    cfg = model.config
    if getattr(model, "is_gradient_checkpointing", False):
        return False
    if model.training and float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    return not hooked(*model.model.modules())


def hooked(*modules) -> bool:
    """Whether a hook would see these modules' forward (or backward) run: a grpokit path that
    computes them from their parameters instead must step aside (fault injection, reference dropout)."""
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks) or any(
        mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks
        for mod in modules)


def _proj(h: torch.Tensor, mod) -> torch.Tensor:
    """`mod`'s forward on h: a plain Linear, or a peft LoRA layer's base(h) + sum scaling * B(A(h))
    (the adapters' own parameters, so autograd reaches them; with the adapters disabled, the base
    alone, as peft computes it)."""
    if type(mod) is torch.nn.Linear:
        return linear(h, mod.weight, mod.bias)
    base, parts = lora_parts(mod)
    out = linear(h, base.weight, base.bias)
    for A, B, scaling in parts:       # in the adapter's dtype (peft keeps adapters in float32 over a
        out = (out + F.linear(F.linear(h.to(A.dtype), A), B) * scaling).to(out.dtype)   # 16-bit base)
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (transformers' rotate-half form). x [N, heads, d]; cos, sin [N, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def prompt_shared_states(model, ids: torch.Tensor, att: torch.Tensor, P: int, L: int) -> torch.Tensor:
    """Final hidden states [m, L, H] that predict the L completion tokens of each row.

    ids, att [m, P + L]: left-padded prompts in columns :P (at least one real token each),
    right-padded completions after. The last completion column is not fed (it predicts nothing)."""
    cfg, inner = model.config, model.model
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    eps = cfg.rms_norm_eps
    gqa = nkv != nh
    dev = ids.device

    key = torch.cat([ids[:, :P], att[:, :P]], 1)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)               # u distinct prompts
    u = uniq.shape[0]
    p_ids, p_att = uniq[:, :P], uniq[:, P:].bool()                          # [u, P]
    Lc = L - 1                                                              # completion tokens fed
    c_ids, c_att = ids[:, P:P + Lc], att[:, P:P + Lc].bool()                # [m, Lc]
    m = ids.shape[0]

    # positions as the model's forward gets them: (attention_mask.cumsum - 1).clamp(0)
    p_pos = (p_att.long().cumsum(-1) - 1).clamp(min=0)                      # [u, P]
    c_pos = (p_att.sum(-1)[inv][:, None] + c_att.long().cumsum(-1) - 1).clamp(min=0)   # [m, Lc]
    pos = torch.cat([p_pos.flatten(), c_pos.flatten()])                     # [Np + Nc]
    # padding (short prompts, completions that ended early) goes through no projection: the
    # layers' matmuls see the real tokens only, packed, and attention the padded layout
    real = torch.cat([p_att.flatten(), c_att.flatten()])
    idx = None if bool(real.all()) else real.nonzero().squeeze(1)          # [Nr] real positions
    full = real.numel()
    if idx is not None:
        pos = pos[idx]
    rot = inner.rotary_emb
    freqs = pos[:, None].float() * rot.inv_freq.float().to(dev)[None]
    emb = torch.cat((freqs, freqs), -1)
    scale = float(getattr(rot, "attention_scaling", 1.0))
    dtype = inner.embed_tokens.weight.dtype
    cos = (emb.cos() * scale).to(dtype)[:, None]                            # [N, 1, d]
    sin = (emb.sin() * scale).to(dtype)[:, None]

    # masks (True = attend): prompts causal over their real tokens (a pad query sees itself, so no
    # row is empty); completions see their prompt's real tokens and, causally, their own
    causal_p = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    eye_p = torch.eye(P, dtype=torch.bool, device=dev)
    mask_p = ((causal_p[None] & p_att[:, None, :]) | eye_p[None])[:, None]  # [u, 1, P, P]
    if Lc:
        causal_c = torch.ones(Lc, Lc, dtype=torch.bool, device=dev).tril()
        mask_c = torch.cat([p_att[inv][:, None, :].expand(m, Lc, P),
                            causal_c[None] & c_att[:, None, :]], -1)[:, None]   # [m, 1, Lc, P + Lc]

    Np = u * P

    def unpack(t):                     # [Nr, ...] packed -> [Np + Nc, ...], zeros at padding
        return t if idx is None else t.new_zeros((full, *t.shape[1:])).index_put((idx,), t)

    tokens = torch.cat([p_ids.flatten(), c_ids.flatten()])
    x = F.embedding(tokens if idx is None else tokens[idx], inner.embed_tokens.weight)   # [Nr, H]
    for layer in inner.layers:
        a, mlp = layer.self_attn, layer.mlp
        h = _rms(x, layer.input_layernorm.weight, eps)
        q = unpack(_rope(_proj(h, a.q_proj).view(-1, nh, d), cos, sin))
        k = unpack(_rope(_proj(h, a.k_proj).view(-1, nkv, d), cos, sin))
        v = unpack(_proj(h, a.v_proj).view(-1, nkv, d))
        kp = k[:Np].view(u, P, nkv, d).transpose(1, 2)                      # [u, nkv, P, d]
        vp = v[:Np].view(u, P, nkv, d).transpose(1, 2)
        qp = q[:Np].view(u, P, nh, d).transpose(1, 2)
        o = [F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask_p, enable_gqa=gqa)
             .transpose(1, 2).reshape(Np, nh * d)]
        if Lc:
            kc = torch.cat([kp[inv], k[Np:].view(m, Lc, nkv, d).transpose(1, 2)], 2)   # [m, nkv, P + Lc, d]
            vc = torch.cat([vp[inv], v[Np:].view(m, Lc, nkv, d).transpose(1, 2)], 2)
            qc = q[Np:].view(m, Lc, nh, d).transpose(1, 2)
            o.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask_c, enable_gqa=gqa)
                     .transpose(1, 2).reshape(m * Lc, nh * d))
        o = torch.cat(o) if Lc else o[0]
        x = x + _proj(o if idx is None else o[idx], a.o_proj)
        h = _rms(x, layer.post_attention_layernorm.weight, eps)
        x = x + _proj(F.silu(_proj(h, mlp.gate_proj)) * _proj(h, mlp.up_proj), mlp.down_proj)
    x = unpack(_rms(x, inner.norm.weight, eps))
    first = x[:Np].view(u, P, -1)[:, -1][inv]                               # [m, H] predicts token 0
    if not Lc:
        return first[:, None]
    return torch.cat([first[:, None], x[Np:].view(m, Lc, -1)], 1)
