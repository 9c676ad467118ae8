"""Per-token log-probs (and entropy) of completions, without holding [B, T, V] logits at once.

The backbone runs once over prompt + completion (for dense Llama-family models, grpokit's own
forward, which also runs each distinct prompt once: `grpokit.train.forward`); the LM head is
applied to the completion positions only, in chunks of tokens. When the logits of the whole
micro-batch would exceed `logits_budget_bytes`, each chunk runs under activation checkpointing, so
backward recomputes the chunk's logits instead of keeping them all alive (DESIGN: "log-probs without full-vocabulary logits").

Micro-batches are built from sequences of similar length (`plan_micro_batches`) and trimmed to
their own longest prompt and completion, so padding stays small.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from grpokit.gemm import fast_linears
from grpokit.train import forward as lean_forward
from grpokit.train import head as head_lib


def unwrap(model):
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in its modules)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_and_head(model):
    m = unwrap(model)
    backbone = m.get_decoder() if hasattr(m, "get_decoder") else getattr(m, m.base_model_prefix)
    head = m.get_output_embeddings()
    if backbone is None or head is None:
        raise ValueError(f"{type(m).__name__}: cannot find the decoder and LM head of this model")
    softcap = getattr(m.config, "final_logit_softcapping", None)
    return backbone, head, softcap


@contextlib.contextmanager
def layer_checkpointing(backbone, enabled: bool):
    """Make `model.gradient_checkpointing` act although the policy is in eval mode: transformers
    checkpoints a decoder layer only when that layer's `training` flag is set. The flag is set on the
    checkpointed layers alone (not their submodules, so no dropout turns on) for this forward pass;
    the recomputation in backward does not read it again."""
    layers = [m for m in backbone.modules() if getattr(m, "gradient_checkpointing", False) is True
              and not m.training] if enabled else []
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m in layers:
            m.training = False


@dataclass
class MicroBatch:
    rows: torch.Tensor            # [m] indices into the rollout batch
    input_ids: torch.Tensor       # [m, P + L] left-padded prompt, right-padded completion
    attention_mask: torch.Tensor  # [m, P + L]
    prompt_len: int               # P: completion token j sits at column P + j
    targets: torch.Tensor         # [m, L] completion ids
    mask: torch.Tensor            # [m, L] 1 on real completion tokens


def build_micro_batch(rows: list[int], prompt_ids: list[list[int]], completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor, pad_id: int) -> MicroBatch:
    lens = completion_mask[rows].sum(-1)
    L = max(int(lens.max()), 1)
    P = max(len(prompt_ids[r]) for r in rows)
    m = len(rows)
    ids = torch.full((m, P + L), pad_id, dtype=torch.long)
    att = torch.zeros((m, P + L), dtype=torch.long)
    for k, r in enumerate(rows):
        p = prompt_ids[r]
        ids[k, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        att[k, P - len(p):P] = 1
    ids[:, P:] = completion_ids[rows, :L]
    att[:, P:] = completion_mask[rows, :L]
    return MicroBatch(torch.tensor(rows), ids, att, P, completion_ids[rows, :L].clone(),
                      completion_mask[rows, :L].clone())


PAD_COST = 0.05   # a padded completion position against a real token, for the lean forward: attention
                  # and copies in the padded layout, no matmul. About 0.8 MFLOP of attention at 113 keys
                  # against 21 MFLOP of a token's GEMMs a layer for SmolLM2; the lean forward's length
                  # buckets pad less than the micro-batch's longest row (0.25 before them; 2026-12-07)
MICRO_BATCH_COST = 64   # one more micro-batch against a real token: what a micro-batch pays whatever its
                        # size (the per-operation overhead, smaller GEMMs running below their peak; the
                        # weights' gradient accumulation and the tied embedding's dense gradient too,
                        # until both were added into .grad in place, gemm.grads_in_place)


def plan_micro_batches(total_lengths: list[int], size: int, prompts: list | None = None) -> list[list[int]]:
    """Cut row indices into micro-batches, grouping sequences of similar total length.

    Without `prompts`: `size` rows each. With `prompts` (each row's prompt ids, for the forward that
    runs each distinct prompt of a micro-batch once and leaves padding out of its matmuls:
    `uses_lean_forward`), a micro-batch holds as many rows as fit the tokens that `size` of the
    batch's longest completions under its longest prompt feed (counting each distinct prompt once,
    the completion tokens fed, and a padded position at PAD_COST of a token): completions that
    ended early share a micro-batch with more rows, so the matmuls stay large and the activation
    memory stays within what `size` full rows take. Two orders, rows by total length and rows kept
    together by prompt (prompts ordered by their longest row; a prompt's rows are split over two
    micro-batches only when they do not fit one), are cut so and into `size` rows each; the plan
    that costs least wins: the tokens it feeds plus MICRO_BATCH_COST for each micro-batch (before
    2026-12-07 the tokens alone, so groups whose longest rows differed were never put together:
    with EOS, eight micro-batches of ~150 tokens where four of ~400 fit; docs/performance.md)."""
    order = sorted(range(len(total_lengths)), key=lambda i: total_lengths[i])
    if prompts is None:
        return [order[i:i + size] for i in range(0, len(order), size)]
    keys = [tuple(p) for p in prompts]
    longest: dict[tuple, int] = {}
    for k, t in zip(keys, total_lengths):
        longest[k] = max(longest.get(k, 0), t)
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    by_prompt = sorted(range(len(keys)), key=lambda i: (longest[keys[i]], first[keys[i]], total_lengths[i]))

    def cost(mb):                      # the matmuls' tokens: each distinct prompt of a micro-batch once,
        fed_c = [max(total_lengths[i] - len(keys[i]) - 1, 0) for i in mb]   # completion tokens but the
        return (sum(len(k) for k in {keys[i] for i in mb}) + sum(fed_c)       # last; padding in attention
                + PAD_COST * sum(max(fed_c) - c for c in fed_c))
    # what `size` of the batch's longest completions under its longest prompt feed
    budget = max(map(len, keys), default=0) + size * max((t - len(k) - 1 for t, k in zip(total_lengths, keys)), default=0)

    def cut(rows, whole_groups=False):
        plan, cur, k = [], [], 0
        while k < len(rows):
            n = 1
            if whole_groups:                 # a prompt's rows (consecutive in by_prompt) as one piece,
                while k + n < len(rows) and keys[rows[k + n]] == keys[rows[k]]:   # when they fit at all
                    n += 1
                if cost(rows[k:k + n]) > budget:
                    n = 1
            piece = rows[k:k + n]
            if cur and cost(cur + piece) > budget:
                plan.append(cur)
                cur = []
            cur += piece
            k += n
        return plan + ([cur] if cur else [])
    rows = [[o[i:i + size] for i in range(0, len(o), size)] for o in (by_prompt, order)]   # `size` rows each
    plans = [cut(by_prompt, whole_groups=True), cut(by_prompt), cut(order), *rows]
    return min(plans, key=lambda plan: (sum(cost(mb) for mb in plan) + MICRO_BATCH_COST * len(plan), len(plan)))


def padding_fraction(batches: list[MicroBatch]) -> float:
    real = sum(int(b.attention_mask.sum()) for b in batches)
    total = sum(b.attention_mask.numel() for b in batches)
    return 1.0 - real / max(total, 1)


def uses_lean_forward(model, att: torch.Tensor, P: int) -> bool:
    """Whether `completion_logprobs` runs grpokit's own forward (`grpokit.train.forward`) for this
    model and micro-batch: a supported architecture and every row with a prompt token."""
    return P > 0 and lean_forward.supports(unwrap(model)) and bool(att[:, P - 1].all())


def _head_logprobs(head, softcap, temperature, h, targets, want_entropy: bool):
    with fast_linears(head):                               # also when recomputed by checkpoint
        logits = head(h)                                   # [m, t, V]
    if logits.dtype in (torch.float16, torch.bfloat16):    # log-softmax in float32 at least
        logits = logits.float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, -1)                      # [m, t]
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    if not want_entropy:
        return logp, torch.zeros_like(logp)
    if want_entropy == "grad":                             # an entropy bonus in the loss: differentiable
        return logp, lse - (torch.softmax(logits, -1) * logits).sum(-1)
    with torch.no_grad():
        p = torch.softmax(logits.detach(), -1)
        ent = lse.detach() - (p * logits.detach()).sum(-1)
    return logp, ent


def completion_logprobs(model, mb: MicroBatch, *, temperature: float = 1.0, chunk_tokens: int = 1024,
                        want_entropy: bool = False, logits_budget_bytes: int = 256 << 20
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | prefix) for each completion token of `mb`: ([m, L], entropy [m, L]).
    `want_entropy`: False (zeros), True (detached), or "grad" (differentiable, for an entropy bonus).

    Logits are divided by `temperature`, matching the distribution the sampler drew from.
    Padding positions hold 0.
    """
    with fast_linears(model):
        return _completion_logprobs(model, mb, temperature, chunk_tokens, want_entropy, logits_budget_bytes)


def _completion_logprobs(model, mb, temperature, chunk_tokens, want_entropy, logits_budget_bytes):
    backbone, head, softcap = backbone_and_head(model)
    dev = head.weight.device
    ids, att = mb.input_ids.to(dev), mb.attention_mask.to(dev)
    P, L = mb.prompt_len, mb.targets.shape[1]
    if uses_lean_forward(model, att, P):                   # prompts once, fused ops (grpokit.train.forward)
        h = lean_forward.prompt_shared_states(unwrap(model), ids, att, P, L)
    else:
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        with layer_checkpointing(backbone, torch.is_grad_enabled()):
            hidden = backbone(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).last_hidden_state
        h = hidden[:, P - 1:P - 1 + L]                     # [m, L, H] states that predict the completion
    targets = mb.targets.to(dev)
    real = mb.mask.to(dev).bool()
    packed = not bool(real.all())          # the head sees real completion tokens only, packed in one row
    if packed:
        h, targets = h[real][None], targets[real][None]
    m, L = h.shape[:2]
    vocab = head.weight.shape[0]
    need_ckpt = torch.is_grad_enabled() and m * L * vocab * 4 > logits_budget_bytes
    fused = head_lib.applies(head, softcap, want_entropy, h, targets)   # native row kernels (grpokit.train.head)

    def one(h, targets, keep):
        if fused:
            return head_lib.logprobs(h, head.weight, targets, temperature, want_entropy, keep_logits=keep)
        args = (head, softcap, temperature, h, targets, want_entropy)
        return _head_logprobs(*args) if keep else checkpoint(_head_logprobs, *args, use_reentrant=False)
    if not need_ckpt and m * L <= max(chunk_tokens, 1) * 4:
        logp, ent = one(h, targets, True)
    else:
        step = max(1, chunk_tokens // max(m, 1))
        parts = [one(h[:, s:s + step], targets[:, s:s + step], not need_ckpt) for s in range(0, L, step)]
        logp = torch.cat([p[0] for p in parts], 1)
        ent = torch.cat([p[1] for p in parts], 1)
    if packed:                             # back to [rows, L], 0 at padding
        return (logp.new_zeros(real.shape).index_put((real,), logp[0]),
                ent.new_zeros(real.shape).index_put((real,), ent[0]))
    return logp, ent


@torch.no_grad()
def padded_logprobs(model, mbs: list[MicroBatch], shape: tuple[int, int], *, temperature: float = 1.0,
                    chunk_tokens: int = 1024, forward=None) -> torch.Tensor:
    """Log-probs of the rows covered by `mbs` under `model`, as a [B, T] CPU tensor in the model's
    output dtype (float32 when nothing is computed); rows not covered and positions past a row's
    end hold 0. The model runs in eval mode (no dropout) unless the caller installed dropout hooks.
    `forward(mb)`: what computes a micro-batch's (log-probs, entropy), if not `completion_logprobs`
    on `model` (a data-parallel worker's wrapped module)."""
    out = None
    was = model.training
    model.eval()
    try:
        for mb in mbs:
            lp, _ = (forward(mb) if forward is not None else
                     completion_logprobs(model, mb, temperature=temperature, chunk_tokens=chunk_tokens))
            L = lp.shape[1]
            if out is None:
                out = torch.zeros(shape, dtype=lp.dtype)
            out[mb.rows, :L] = torch.where(mb.mask.bool(), lp.detach().cpu(), 0.0)
    finally:
        model.train(was)
    return torch.zeros(shape, dtype=torch.float32) if out is None else out
