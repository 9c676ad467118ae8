"""In-process generation with a transformers causal LM and its KV cache.

Why not `model.generate`: we need the sampler's per-token log-probs, the prompt's forward pass done
once and shared by its G samples, and finished rows dropped from the batch. The loop is small: one
prompt forward for the B prompts, its KV cache expanded to the G samples of each, then one batched
forward per new token over the rows still running.

Two paths. For dense Llama-family models (Qwen2, Llama: `LeanDecoder.supports`) the forward is
grpokit's own lean one over the model's weights with a preallocated KV cache (grpokit.rollout.
decoder): a decode step is ~25 tensor operations per layer and no Python machinery beyond the
sampler, which is what bounds a small model on a CPU. Finished rows are dropped once they are an
eighth of the batch (dropping means copying the cache; until then they run along and their tokens
are discarded). Any other model (LoRA-wrapped, quantized, other architectures) runs its own
forward with a `DynamicCache`, dropping finished rows at once.
"""

from __future__ import annotations

import threading

import torch
from transformers import DynamicCache

from grpokit import hostmem
from grpokit.gemm import fast_linears
from grpokit.rollout.adapters import AdapterMerger, check_adapters
from grpokit.rollout.base import (GenerationCancelled, PromptStreams, RolloutBatch, SamplingParams, check_weights,
                                  sample_next)
from grpokit.rollout.decoder import LeanDecoder


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise GenerationCancelled("generation cancelled")


class HFEngine:
    """Rollout engine over a transformers model: the policy itself (`owns_weights=False`, nothing
    to sync), or a model of its own whose weights `update_weights` replaces after each optimizer
    step (`owns_weights=True`: the decoupled-engine path, run in one process)."""

    cancellable = True          # generate() takes `stop`
    prompt_streams = True       # ... and a PromptStreams for `generator`

    def __init__(self, model, tokenizer, *, lean: bool = True, owns_weights: bool = False):
        """`lean`: use grpokit's own forward for models that `LeanDecoder.supports` (same
        distribution, fewer operations per token); False always runs the model's forward."""
        hostmem.tune()        # a decoding step's logits and sampling buffers reused, not faulted in
        self.model = model
        self.lean = lean
        self.owns_weights = owns_weights
        self.weights_version = 0
        self._adapters = AdapterMerger()      # the base of layers that took LoRA adapters (load_adapters)
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {eos} | set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = sorted(i for i in ids if i is not None)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token: completions could never finish")

    @torch.no_grad()
    def update_weights(self, named_tensors, version: int | None = None) -> None:
        """Load full, Hugging Face-named tensors (`TrainingWorker.export_weights()`) into the
        engine's model. Every parameter must be given (a tied LM head may be left out); a name
        the model does not have, or a shape that differs, is an error. No-op when the engine
        samples with the training module itself."""
        if not self.owns_weights:
            self.weights_version = self.weights_version + 1 if version is None else version
            return
        state = self.model.state_dict()
        given = list(named_tensors)          # checked whole before any is loaded: no half-updated model
        check_weights(((n, t.shape) for n, t in given), *self.expected_weights())
        for name, t in given:
            state[name].copy_(t)
        self._adapters.forget()
        self.weights_version = self.weights_version + 1 if version is None else version

    def load_part(self, named_tensors) -> None:
        """Load some of the model's tensors (one part of an update in parts, checked whole before any
        is loaded); the caller tracks that the parts together give every parameter."""
        state = self.model.state_dict()
        given = list(named_tensors)
        check_weights(((n, t.shape) for n, t in given), *self.expected_weights()[:1], set())
        for name, t in given:
            state[name].copy_(t)
        self._adapters.forget()

    @torch.no_grad()
    def load_adapters(self, named_tensors, specs: dict[str, dict]) -> None:
        """Fold LoRA adapters into the weights (grpokit.rollout.adapters): each adapted layer's weight
        becomes its base (its weight when it first took adapters since the last full load) plus
        scale * B @ A. Checked whole before any layer changes."""
        given = dict(named_tensors)
        check_adapters(((n, t.shape) for n, t in given.items()), specs, self.expected_weights()[0])
        self._adapters.apply(self.model.state_dict(), given, specs)

    def expected_weights(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """(shape of every tensor `update_weights` takes, the names it must be given: every
        parameter but a tied LM head)."""
        shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        return shapes, {n for n, _ in self.model.named_parameters()} - tied

    def release_memory(self) -> None:
        """Free what generation holds between rollouts (nothing for this engine: the KV cache
        lives only inside `generate`)."""

    def resume_memory(self) -> None:
        """Undo `release_memory`."""

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | PromptStreams | None = None, *,
                 stop: threading.Event | None = None) -> RolloutBatch:
        """`generator`: one stream for the batch, or a `PromptStreams` (one per prompt: a prompt's
        completions then do not depend on the rest of the batch). `stop`: checked before every
        forward pass; once set, GenerationCancelled is raised (a rollout server whose client left)."""
        model, dev = self.model, next(self.model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            if any(len(p) == 0 for p in prompt_ids):
                raise ValueError("empty prompt: every prompt needs at least one token")
            if isinstance(generator, PromptStreams) and len(generator) != len(prompt_ids):
                raise ValueError(f"{len(generator)} prompt streams for {len(prompt_ids)} prompts")
            if self.lean and LeanDecoder.supports(model) and LeanDecoder.folds_fit(model):
                return self._generate_lean(model, dev, prompt_ids, params, generator, stop)
            with fast_linears(model):
                return self._generate(model, dev, prompt_ids, params, generator, stop)
        finally:
            model.train(was_training)

    def _prompts(self, prompt_ids, dev):
        """Left-padded prompt ids and mask, [B, P]."""
        B, P = len(prompt_ids), max(len(p) for p in prompt_ids)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        return ids.to(dev), mask.to(dev)

    def _batch(self, prompt_ids, G, tokens, logps, eos_at, n_resampled) -> RolloutBatch:
        """Assemble the result. tokens / logps: [N, T] with anything after a row's end ignored;
        eos_at: [N] index of the row's first EOS, or -1 when it ran to the length limit."""
        T = tokens.shape[1]
        lengths = torch.where(eos_at >= 0, eos_at + 1, T)
        L = int(lengths.max().item()) if len(lengths) else 0
        tokens, logps = tokens[:, :L], logps[:, :L]
        cmask = (torch.arange(L, device=tokens.device)[None, :] < lengths[:, None]).long()
        tokens = tokens.masked_fill(cmask == 0, self.pad_id).cpu()
        logps = logps.masked_fill(cmask == 0, 0.0).cpu()         # not a product: 0 * inf would be NaN
        texts = self.tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(G)],
            completion_ids=tokens, completion_mask=cmask.cpu(), sampler_logprobs=logps,
            finish_reason=["eos" if e >= 0 else "length" for e in eos_at.tolist()],
            completions=texts, resampled=int(n_resampled),
        )

    def _generate_lean(self, model, dev, prompt_ids, params, generator, stop=None) -> RolloutBatch:
        B, G, T = len(prompt_ids), params.n, params.max_new_tokens
        ids, pmask = self._prompts(prompt_ids, dev)
        P = ids.shape[1]
        N = B * G
        dec = LeanDecoder(model, rows=N)
        padded = bool((pmask == 0).any())
        # the last token is never fed back; the prompts' keys once per prompt where the native
        # attention serves (LeanDecoder.alloc)
        dec.alloc(N, P + T - 1, prompts=B, prefix=P, prefix_mask=pmask.bool() if padded else None)
        cos_t, sin_t = dec.rope_table(P + T)
        if padded:                                               # left padding: explicit masks
            pos = (pmask.cumsum(-1) - 1).clamp(min=0)            # [B, P]
            cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]  # [B, 1, P, d]
            valid = pmask.bool()
            causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
            eye = torch.eye(P, dtype=torch.bool, device=dev)     # pad queries see themselves: no NaN
            m = ((causal[None] & valid[:, None, :]) | eye[None])[:, None]
            keymask = torch.ones((N, 1, 1, P + T - 1), dtype=torch.bool, device=dev)
            keymask[:, 0, 0, :P] = valid.repeat_interleave(G, 0)
            next_pos = pmask.sum(-1).repeat_interleave(G, 0)     # [N] position of completion token 0
        else:
            cos, sin, m = cos_t[:P], sin_t[:P], None
        _check(stop)
        logits = dec.forward(ids, 0, cos, sin, m, expand=G)      # [N, V]

        eos = torch.tensor(self.eos_ids, device=dev)
        out_tok = torch.full((N, T), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((N, T), dtype=torch.float32, device=dev)
        tok_buf, lp_buf = out_tok.clone(), out_lp.clone()        # a row's unsampled columns stay pad / 0
        orig = torch.arange(N, device=dev)                       # row of the full batch, per live row
        done = torch.zeros(N, dtype=torch.bool, device=dev)
        n_resampled = torch.zeros((), dtype=torch.long, device=dev)
        stop_at_eos = not params.ignore_eos
        rows = N
        streams = generator if isinstance(generator, PromptStreams) else None
        for t in range(T):
            u = streams.uniforms(G).to(dev)[orig] if streams is not None else None
            tok, lp, res = sample_next(logits, params, generator if streams is None else None, u)
            tok_buf[:, t] = tok
            lp_buf[:, t] = lp
            if params.resample_threshold is not None:
                n_resampled += res.sum()
            if t == T - 1:
                break
            if stop_at_eos:
                done |= torch.isin(tok, eos)
                n_done = int(done.sum())
                if n_done == rows:
                    break
                if n_done * 8 >= rows:                           # drop the finished rows
                    fin, keep = done.nonzero().squeeze(-1), (~done).nonzero().squeeze(-1)
                    out_tok[orig[fin]] = tok_buf[fin]
                    out_lp[orig[fin]] = lp_buf[fin]
                    orig, tok_buf, lp_buf, tok = orig[keep], tok_buf[keep], lp_buf[keep], tok[keep]
                    dec.select(keep)
                    if padded:
                        keymask, next_pos = keymask[keep], next_pos[keep]
                    done = done[keep]
                    rows = len(keep)
            s = P + t                                            # cache column of token t
            if padded:
                p = next_pos + t
                cos, sin = cos_t[p][:, None, None], sin_t[p][:, None, None]
                m = None if dec.split else keymask[..., :s + 1]     # split: the decoder masks the prompts
            else:
                cos, sin, m = cos_t[s], sin_t[s], None
            _check(stop)
            logits = dec.forward(tok[:, None], s, cos, sin, m)
        out_tok[orig] = tok_buf
        out_lp[orig] = lp_buf
        if stop_at_eos:
            hit = torch.isin(out_tok, eos)
            hit[:, t + 1:] = False                               # columns never sampled
            eos_at = torch.where(hit.any(-1), hit.int().argmax(-1), -1)
        else:
            eos_at = torch.full((N,), -1, dtype=torch.long, device=dev)
        return self._batch(prompt_ids, G, out_tok, out_lp, eos_at, n_resampled)

    def _generate(self, model, dev, prompt_ids, params, generator, stop=None) -> RolloutBatch:
        B, G, T = len(prompt_ids), params.n, params.max_new_tokens
        ids, mask = self._prompts(prompt_ids, dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache()
        _check(stop)
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
        streams = generator if isinstance(generator, PromptStreams) else None
        for t in range(T):
            u = streams.uniforms(G).to(dev)[active] if streams is not None else None
            tok, lp, res = sample_next(logits, params, generator if streams is None else None, u)
            n_resampled += res.sum()
            tokens[active, t] = tok
            logps[active, t] = lp
            lengths[active] += 1
            done = torch.isin(tok, eos) if not params.ignore_eos else torch.zeros_like(tok, dtype=torch.bool)
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
            _check(stop)
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1

        eos_at = torch.where(finished_eos, lengths - 1, -1)
        return self._batch(prompt_ids, G, tokens, logps, eos_at, n_resampled)
