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
  ended early are left out of the matrix (the real tokens packed) -- with EOS, a group's rows end
  far apart, and its padding was half of what the projections multiplied;
- attention gathers the packed tokens into padded layouts: the prompts', and the completions' cut
  into up to MAX_BUCKETS buckets of rows by length (`buckets`), each attended at its own longest
  row's length, so a micro-batch's short rows are not padded to its longest one;
- the token embedding's weight gradient is added into `.grad` row by row by micro-batches after
  the first (`grpokit.gemm.embedding`, under the worker's `grads_in_place`), not built dense;
- in float32 on the CPU, RMSNorm, the SwiGLU gate and the rotary embedding are native code, one
  pass each forward and backward (`grpokit.train.layer_ops`), else `torch.nn.functional.rms_norm`,
  `silu(g) * u` and rotary as one expression per tensor; attention, in float32 on the CPU, native code
  over the packed tokens themselves (`grpokit.train.packed_attention`: no padded layout, no copies,
  no masks), else `scaled_dot_product_attention` over the padded layouts above, with grouped KV
  heads and an explicit boolean mask.

Results equal the model's forward up to float summation order (tests/train/test_forward.py checks
log-probs and gradients against it). `supports(model)` says when this path applies; otherwise
(quantized layers, DoRA, other architectures, gradient checkpointing, attention or LoRA dropout in
training mode, forward hooks on the decoder such as reference dropout's) the caller runs the
model's own forward. peft LoRA layers are computed as peft computes them, base(x) + scaling *
B(A(x)) with the adapters' own parameters, so the gradients reach the adapters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpokit.gemm import embedding, linear
from grpokit.train import layer_ops, packed_attention
from grpokit.rollout.decoder import LeanDecoder, lora_parts
from grpokit.rollout.decoder import rms_norm as _rms

_enabled = True
NATIVE = True          # the attention through grpokit/csrc/packed_attend.c where it serves
NATIVE_LAYER_OPS = True   # RMSNorm, SwiGLU and rotary through grpokit/csrc/layer_ops.c where they serve


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


CALL_COST = 4096
"""What one more attention call costs, in (query, key) pairs: a call's fixed part (threads, masks,
the index copies around it) measured at ~0.3 ms on a 2-core machine, where a pair of SmolLM2's
9 heads costs ~0.07 us. Rows of different lengths are cut into buckets when that saves more."""
MAX_BUCKETS = 4


@dataclass
class _Layout:
    """Where attention finds each token: the slots of the prompts' padded layout [u, P], then of
    each bucket's [rows, L_b] of completions, concatenated; `slot` [Nr] is each packed real token's
    slot (padding slots hold zeros). Placing tokens into slots is a scatter, whose backward is a
    gather; the attention's output is read back from the same slots. When the completions fill
    their buckets' slots in their packed order with no padding (every row fed to the same length, as
    with EOS ignored), `direct` is the number of the prompts' real tokens: the completions' part is
    then a view of the packed tensors, and only the prompts' tokens are scattered and gathered."""
    slot: torch.Tensor
    shapes: list                     # (u, P), then (rows, L_b) per bucket
    prompt_of: list                  # per bucket: the prompt index of each row
    masks: list                      # [u, 1, P, P], then [rows, 1, L_b, P + L_b] per bucket
    direct: int | None = None        # see above

    @property
    def sizes(self) -> list[int]:    # slots per part
        return [n * length for n, length in self.shapes]


def buckets(lengths: list[int], P: int, call_cost: int, most: int = MAX_BUCKETS) -> list[int]:
    """Cut rows sorted by length (ascending, each > 0) into at most `most` runs, each attended at
    its longest row's length, minimising sum(rows * L * (P + L) + call_cost): the end (exclusive)
    of each run. Cuts fall between distinct lengths (at most 32 candidates, spread over them)."""
    n = len(lengths)
    ends = [i + 1 for i in range(n - 1) if lengths[i] != lengths[i + 1]] + [n]
    if len(ends) > 32:
        ends = sorted({ends[round(j * (len(ends) - 1) / 31)] for j in range(32)})

    def cost(a, b):                  # rows a..b-1 (b exclusive), at length lengths[b - 1]
        ln = lengths[b - 1]
        return (b - a) * ln * (P + ln) + call_cost
    best = {(0, 0): (0.0, [])}       # (runs used, rows covered) -> (cost, ends)
    for k in range(1, most + 1):
        for e in ends:
            cands = [(c + cost(s, e), cut + [e]) for (kk, s), (c, cut) in best.items() if kk == k - 1 and s < e]
            if cands:
                best[(k, e)] = min(cands, key=lambda t: t[0])
    return min((v for (k, e), v in best.items() if e == n and k > 0), key=lambda t: t[0])[1]


def _layout(p_att: torch.Tensor, c_att: torch.Tensor, inv: torch.Tensor, P: int, Lc: int) -> _Layout:
    dev = p_att.device
    u, m = p_att.shape[0], c_att.shape[0]
    real = torch.cat([p_att.flatten(), c_att.flatten()])
    Nr = int(real.sum())
    pidx = torch.zeros(real.numel(), dtype=torch.long, device=dev)   # each real position's packed index
    pidx[real] = torch.arange(Nr, device=dev)                        # (read at real positions only)
    # masks (True = attend): prompts causal over their real tokens (a pad query sees itself, so no
    # row is empty); completions see their prompt's real tokens and, causally, their own
    causal_p = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    eye_p = torch.eye(P, dtype=torch.bool, device=dev)
    shapes = [(u, P)]
    masks = [((causal_p[None] & p_att[:, None, :]) | eye_p[None])[:, None]]
    slot_of = torch.empty(Nr, dtype=torch.long, device=dev)
    slot_of[pidx[:u * P][p_att.flatten()]] = torch.arange(u * P, device=dev)[p_att.flatten()]
    prompt_of, off = [], u * P
    if Lc:
        c_idx = pidx[u * P:].view(m, Lc)
        last = (c_att * torch.arange(1, Lc + 1, device=dev)).amax(-1)          # a row's length fed
        order = torch.argsort(last, stable=True)
        order = order[last[order] > 0]                                        # rows with tokens fed
        lens = last[order].tolist()
        causal = torch.ones(Lc, Lc, dtype=torch.bool, device=dev).tril()
        start = 0
        for end in (buckets(lens, P, CALL_COST) if lens else []):
            rows, Lb = order[start:end], lens[end - 1]
            n, ca = end - start, c_att[rows, :Lb]
            shapes.append((n, Lb))
            prompt_of.append(inv[rows])
            masks.append(torch.cat([p_att[inv[rows]][:, None, :].expand(n, Lb, P),
                                    causal[None, :Lb, :Lb] & ca[:, None, :]], -1)[:, None])
            slot_of[c_idx[rows, :Lb][ca]] = (off + torch.arange(n * Lb, device=dev)).view(n, Lb)[ca]
            start, off = end, off + n * Lb
    npr = int(p_att.sum())
    direct = npr if (off - u * P == Nr - npr and torch.equal(
        slot_of[npr:], torch.arange(u * P, off, device=dev))) else None
    return _Layout(slot_of, shapes, prompt_of, masks, direct)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: _Layout, gqa: bool) -> torch.Tensor:
    """Attention of the packed real tokens q [Nr, nh, d], k, v [Nr, nkv, d] -> [Nr, nh * d]: the
    prompts in their padded layout (causal over their real tokens), each bucket of completions
    attending to its rows' prompts and, causally, to their own tokens."""
    sizes, npr = lay.sizes, lay.direct

    def slots(t):
        if npr is None:
            return t.new_zeros((sum(sizes), *t.shape[1:])).index_put((lay.slot,), t).split(sizes)
        first = t.new_zeros((sizes[0], *t.shape[1:])).index_put((lay.slot[:npr],), t[:npr])
        return [first, *t[npr:].split(sizes[1:])] if len(sizes) > 1 else [first]
    Q, K, V = slots(q), slots(k), slots(v)
    nh, nkv, d = q.shape[1], k.shape[1], q.shape[2]
    u, P = lay.shapes[0]
    kp, vp = (t[0].view(u, P, nkv, d).transpose(1, 2) for t in (K, V))     # [u, nkv, P, d]
    outs = [F.scaled_dot_product_attention(Q[0].view(u, P, nh, d).transpose(1, 2), kp, vp,
                                           attn_mask=lay.masks[0], enable_gqa=gqa)]
    for b in range(1, len(lay.shapes)):
        n, Lb = lay.shapes[b]
        pr = lay.prompt_of[b - 1]                                            # each row's prompt
        kb = torch.cat([kp[pr], K[b].view(n, Lb, nkv, d).transpose(1, 2)], 2)     # [n, nkv, P + Lb, d]
        vb = torch.cat([vp[pr], V[b].view(n, Lb, nkv, d).transpose(1, 2)], 2)
        outs.append(F.scaled_dot_product_attention(Q[b].view(n, Lb, nh, d).transpose(1, 2), kb, vb,
                                                   attn_mask=lay.masks[b], enable_gqa=gqa))
    outs = [t.transpose(1, 2).reshape(-1, nh * d) for t in outs]
    if npr is None:
        return torch.cat(outs)[lay.slot]
    return torch.cat([outs[0][lay.slot[:npr]], *outs[1:]])


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

    if NATIVE and nh % nkv == 0 and packed_attention.usable(ids.device, inner.embed_tokens.weight.dtype):
        pl = packed_attention.plan(p_att, c_att, inv)
        attend = (lambda q, k, v: packed_attention.attend(q, k, v, pl))
    else:
        lay = _layout(p_att, c_att, inv, P, Lc)
        attend = (lambda q, k, v: _attend(q, k, v, lay, gqa))
    Np = u * P

    def unpack(t):                     # [Nr, ...] packed -> [Np + Nc, ...], zeros at padding
        return t if idx is None else t.new_zeros((full, *t.shape[1:])).index_put((idx,), t)

    tokens = torch.cat([p_ids.flatten(), c_ids.flatten()])
    if NATIVE_LAYER_OPS:
        norm, glu = (lambda x, w: layer_ops.rms_norm(x, w, eps, _rms)), layer_ops.swiglu
        rope = (lambda x: layer_ops.rope(x, cos, sin, _rope))
    else:
        norm, glu = (lambda x, w: _rms(x, w, eps)), (lambda g, u: F.silu(g) * u)
        rope = (lambda x: _rope(x, cos, sin))
    x = embedding(tokens if idx is None else tokens[idx], inner.embed_tokens.weight)     # [Nr, H]
    for layer in inner.layers:
        a, mlp = layer.self_attn, layer.mlp
        h = norm(x, layer.input_layernorm.weight)
        q = rope(_proj(h, a.q_proj).view(-1, nh, d))
        k = rope(_proj(h, a.k_proj).view(-1, nkv, d))
        v = _proj(h, a.v_proj).view(-1, nkv, d)
        x = x + _proj(attend(q, k, v), a.o_proj)
        h = norm(x, layer.post_attention_layernorm.weight)
        x = x + _proj(glu(_proj(h, mlp.gate_proj), _proj(h, mlp.up_proj)), mlp.down_proj)
    x = unpack(norm(x, inner.norm.weight))
    first = x[:Np].view(u, P, -1)[:, -1][inv]                               # [m, H] predicts token 0
    if not Lc:
        return first[:, None]
    return torch.cat([first[:, None], x[Np:].view(m, Lc, -1)], 1)
