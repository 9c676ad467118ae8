"""Supervised fine-tuning on (prompt, completion) pairs: the demo's warm start and its control run.

Loss: mean token cross-entropy on the completion (+ EOS) only; the prompt is context. Completions are
encoded the way the rollout engine generates them (completion ids then EOS), so a warm-started
model's greedy output is directly comparable with what GRPO samples.
"""

from __future__ import annotations

import random
import time

import torch

from grpokit.train.logprobs import build_micro_batch, completion_logprobs


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    prompts = [tokenizer(p)["input_ids"] for p, _ in pairs]
    comps = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, c in pairs]
    L = max(len(c) for c in comps)
    ids = torch.full((len(pairs), L), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), L), dtype=torch.long)
    for i, c in enumerate(comps):
        ids[i, :len(c)] = torch.tensor(c)
        mask[i, :len(c)] = 1
    return prompts, ids, mask


def sft(model, tokenizer, pairs_fn, *, steps: int | None = None, seconds: float | None = None,
        batch_size: int = 64, lr: float = 1e-3, warmup: int = 20, seed: int = 0, weight_decay: float = 0.01,
        log_every: int = 0, on_log=None) -> dict:
    """Train on batches from `pairs_fn(batch_size, rng) -> [(prompt, completion)]` for `steps`
    optimizer steps or `seconds` of wall time, whichever comes first (at least one must be set)."""
    if steps is None and seconds is None:
        raise ValueError("sft needs steps or seconds")
    rng = random.Random(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay, betas=(0.9, 0.98))
    total = steps or 10**9
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    model.train()
    t0, step, last = time.perf_counter(), 0, float("nan")
    while step < total and (seconds is None or time.perf_counter() - t0 < seconds):
        prompts, ids, mask = encode_pairs(tokenizer, pairs_fn(batch_size, rng))
        mb = build_micro_batch(list(range(len(prompts))), prompts, ids, mask, tokenizer.pad_token_id)
        logp, _ = completion_logprobs(model, mb)
        loss = -(logp * mb.mask).sum() / mb.mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        last = loss.item()
        if log_every and on_log and step % log_every == 0:
            on_log(step, last)
    model.eval()
    return {"steps": step, "loss": last, "seconds": time.perf_counter() - t0}
