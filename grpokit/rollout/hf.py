"""In-process generation with a transformers causal LM and its KV cache.

Why not `model.generate`: we need the sampler's per-token log-probs, the prompt's forward pass done
once and shared by its G samples, and finished rows dropped from the batch as soon as they end.
The loop is small: one prompt forward for the B prompts, `batch_repeat_interleave(G)` on the
cache, then one batched forward per new token over the rows still running.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from grpokit.rollout.base import RolloutBatch, SamplingParams, sample_next


class HFEngine:
    """Rollout engine over a transformers model (the policy itself: no weight sync needed)."""

    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {eos} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = sorted(i for i in ids if i is not None)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token: completions could never finish")

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        model, dev = self.model, next(self.model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            return self._generate(model, dev, prompt_ids, params, generator)
        finally:
            model.train(was_training)

    def _generate(self, model, dev, prompt_ids, params, generator) -> RolloutBatch:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("empty prompt: every prompt needs at least one token")
        B, G, T = len(prompt_ids), params.n, params.max_new_tokens
        P = max(len(p) for p in prompt_ids)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, p in enumerate(prompt_ids):                       # left padding
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache()
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].repeat_interleave(G, 0)       # [N, V]
        cache = out.past_key_values
        if G > 1:
            cache.batch_repeat_interleave(G)
        N = B * G
        mask = mask.repeat_interleave(G, 0)                      # [N, P + t]
        next_pos = pos[:, -1].repeat_interleave(G, 0) + 1        # [N]

        tokens = torch.full((N, T), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((N, T), dtype=torch.float32, device=dev)
        lengths = torch.zeros(N, dtype=torch.long, device=dev)
        finished_eos = torch.zeros(N, dtype=torch.bool, device=dev)
        active = torch.arange(N, device=dev)                     # rows of the full batch still running
        eos = torch.tensor(self.eos_ids, device=dev)
        n_resampled = torch.zeros((), dtype=torch.long, device=dev)
        for t in range(T):
            tok, lp, res = sample_next(logits, params, generator)
            n_resampled += res.sum()
            tokens[active, t] = tok
            logps[active, t] = lp
            lengths[active] += 1
            done = torch.isin(tok, eos)
            if done.any():
                finished_eos[active[done]] = True
            if t == T - 1:
                break
            keep = ~done
            if not keep.any():
                break
            if done.any():                                       # drop finished rows
                sel = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(sel)
                active, tok, mask, next_pos = active[sel], tok[sel], mask[sel], next_pos[sel]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1

        L = int(lengths.max().item()) if N else 0
        tokens, logps = tokens[:, :L], logps[:, :L]
        cmask = (torch.arange(L, device=dev)[None, :] < lengths[:, None]).long()
        tokens = tokens.masked_fill(cmask == 0, self.pad_id)
        logps = logps * cmask
        texts = self.tokenizer.batch_decode(tokens.cpu().tolist(), skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(G)],
            completion_ids=tokens.cpu(), completion_mask=cmask.cpu(), sampler_logprobs=logps.cpu(),
            finish_reason=["eos" if f else "length" for f in finished_eos.tolist()],
            completions=texts, resampled=int(n_resampled),
        )
