"""The rollout contract: what an engine returns, and how the next token is drawn.

Any engine (the in-process transformers one here; vLLM or a rollout server later) implements
`RolloutEngine` and hands back a `RolloutBatch`; `grpokit.rollout.registry` names the engines
that `rollout.engine` can select.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from grpokit.rollout import native_sample


@dataclass
class SamplingParams:
    n: int = 1
    """Completions per prompt (G)."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = 0
    resample_threshold: float | None = None
    """Over-confidence resampling: see `sample_next`."""
    ignore_eos: bool = False
    """Do not stop at EOS: every row runs to `max_new_tokens` (EOS tokens stay in the completion)."""


@dataclass
class RolloutBatch:
    """N = num_prompts * n completions, group after group (the n samples of prompt 0 first)."""

    prompt_ids: list[list[int]]          # [N] prompt token ids (unpadded), repeated per sample
    completion_ids: torch.Tensor         # [N, L] right-padded with pad_id
    completion_mask: torch.Tensor        # [N, L] 1 for generated tokens (EOS included)
    sampler_logprobs: torch.Tensor       # [N, L] log-prob of each token under the distribution sampled from
    finish_reason: list[str]             # [N] "eos" or "length"
    completions: list[str]               # [N] decoded text, special tokens removed
    resampled: int = 0                   # positions where over-confidence resampling fired
    weights_version: int | None = None   # the weights that sampled it, for engines that hold their own
    action_mask: torch.Tensor | None = None  # [N, L] multi-turn: 1 on sampled tokens, 0 on observations (None: = completion_mask)
    episodes: list[dict] | None = None   # [N] multi-turn: each episode's record (grpokit.rollout.episodes)
    timing: dict | None = None           # multi-turn: engine calls, rows in them, tool latencies

    @property
    def lengths(self) -> torch.Tensor:   # [N]
        return self.completion_mask.sum(-1)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


class RolloutEngine(Protocol):
    """What the driver needs of a rollout engine.

    `owns_weights`: False when the engine samples with the training module itself (its sampler
    log-probs are then the trainer's own, up to the lean decoder's rounding); True when it holds a
    copy of the weights (another process, vLLM, a server), which `update_weights` refreshes after
    every optimizer step with full, Hugging Face-named tensors, and whose numerics may differ
    from the trainer's (the driver then recomputes pi_old and corrects with importance weights,
    docs/algorithms.md). `release_memory` / `resume_memory` free and restore what the engine
    holds between rollouts (a colocated engine's KV cache); no-ops where there is nothing.

    `generate`'s `generator` is one stream for the batch, or (in a data-parallel job) a
    `PromptStreams` with one stream per prompt, from which prompt j's rows must draw alone."""

    owns_weights: bool

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | PromptStreams | None = None) -> RolloutBatch: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


def check_weights(given: Iterable[tuple[str, tuple[int, ...]]], shapes: dict[str, tuple[int, ...]],
                  required: set[str]) -> None:
    """Refuse a weight update before anything is loaded: every (name, shape) in `given` must be one
    of the engine's `shapes`, and every name in `required` must be given. KeyError for an unknown
    name, ValueError for a wrong shape or a missing parameter."""
    given = list(given)
    for name, shape in given:
        if name not in shapes:
            raise KeyError(f"update_weights: the engine's model has no tensor {name!r}")
        if tuple(shape) != tuple(shapes[name]):
            raise ValueError(f"update_weights: {name} has shape {tuple(shape)}, the engine's {tuple(shapes[name])}")
    missing = required - {name for name, _ in given}
    if missing:
        raise ValueError(f"update_weights: {len(missing)} parameters not sent, e.g. {sorted(missing)[:3]}")


class GenerationCancelled(RuntimeError):
    """A generation stopped early because its `stop` event was set (a rollout server's client went
    away): nothing is returned."""


class NonFiniteLogits(ValueError):
    """The model's next-token logits held NaN or +inf (or a row had every token at -inf), so no
    token can be drawn. The trainer's non-finite guard treats the step as bad (skipped, counted,
    rolled back after `guard.max_consecutive_bad` in a row)."""


def check_logits(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits unless every row of `logits` [B, V] can be sampled from: no NaN, no
    +inf, and at least one token above -inf (-inf alone is a masked token, which is fine). That is
    exactly "the row's max is finite" (max propagates NaN), one cheap reduction per token. On a GPU
    it reads one flag back to the host per token (the EOS check of the decoding loops reads one
    already; only `ignore_eos` decoding gains a sync)."""
    bad = ~torch.isfinite(logits.amax(-1))       # [B]
    if bad.any():
        raise NonFiniteLogits(
            f"non-finite logits during sampling: {int(bad.sum())} of {len(bad)} rows have NaN/inf "
            "next-token logits (the forward pass overflowed or the weights are not finite)")


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: [B, V] (raw). Returns (tokens [B], logprobs [B], resampled [B]).

    The log-prob is that of the distribution actually sampled from: after temperature, top-k and
    top-p truncation, and, with `resample_threshold` (the over-confidence resampling of the
    practitioner's rule "DAPO as practised", docs/training.md), after removing the over-confident
    token. When the top token's probability exceeds the threshold, that row samples from the same
    distribution with the top token excluded and renormalised; its recorded log-prob is log q(token)
    under that renormalised q, so an importance ratio built on it stays correct.

    The token is drawn by `draw` (one uniform number per row, not one per vocabulary entry), or at
    the given quantiles `u` [B] (from `PromptStreams`) instead of numbers drawn from `generator`.
    At a temperature with no top-k, top-p or resampling, on float32 CPU logits, one native kernel
    does it all at the same quantiles (grpokit.rollout.native_sample; PyTorch's path elsewhere).
    Raises NonFiniteLogits when a row has NaN/inf logits (no distribution to draw from).
    """
    if (params.temperature > 0 and params.top_p >= 1.0 and params.resample_threshold is None
            and not (params.top_k and params.top_k < logits.shape[-1])):
        got, u = _native_draw(logits, params.temperature, generator, u)
        if got is not None:
            return got
    check_logits(logits)
    logits = logits.float()
    if params.temperature == 0:
        tok = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok, logp, torch.zeros_like(tok, dtype=torch.bool)
    logits = logits / params.temperature                                  # [B, V]
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, -1)) >= params.top_p  # keep the token crossing p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    resampled = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if params.resample_threshold is not None:
        probs = torch.softmax(logits, -1)
        top_p, top_i = probs.max(-1)
        # only rows with another token left to choose from can be resampled
        finite_count = torch.isfinite(logits).sum(-1)
        resampled = (top_p > params.resample_threshold) & (finite_count > 1)
        if resampled.any():
            logits = logits.clone()
            rows = resampled.nonzero().squeeze(-1)
            logits[rows, top_i[rows]] = float("-inf")
    probs = torch.softmax(logits, -1)
    tok = draw(probs, generator) if u is None else inverse_cdf(probs, u)
    return tok, probs.gather(-1, tok[:, None]).squeeze(-1).log(), resampled


def _native_draw(logits, temperature, generator, u):
    """(tokens, log-probs, resampled) of the plain path (temperature only) in one native kernel
    (grpokit.rollout.native_sample), at the quantiles `draw` would use (the same numbers from
    `generator`, or `u`), and those quantiles; (None, u) where it does not serve (not float32 CPU
    logits, no compiler), and PyTorch's path runs at the quantiles returned (None: not drawn yet)."""
    if not native_sample.suits(logits) or native_sample.sample_fn() is None:
        return None, u
    if u is None:
        u = torch.rand((logits.shape[0],), dtype=torch.float64, generator=generator)
    got = native_sample.sample(logits, 1.0 / temperature, u)
    if got is None:
        return None, u
    tok, logp, bad = got
    if bad:
        check_logits(logits)                 # raises NonFiniteLogits, naming the rows
        return None, u
    return (tok, logp, torch.zeros(len(tok), dtype=torch.bool)), u


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [B, V] (non-negative, each row with some mass; rows need not
    sum to 1), drawn exactly from the categorical distribution probs / probs.sum(-1).

    Inverse transform sampling: one uniform u per row, and the token is the first whose cumulative
    mass exceeds u times the row's total. `torch.multinomial` draws one exponential random number
    per vocabulary entry instead (49,152 a row for a Llama-3-sized vocabulary), which took a
    seventh of a decoding step of a 135 M-parameter model on a CPU. The cumulative sums are in
    float64 (`inverse_cdf`: over blocks of the vocabulary, then inside one), so each token's share
    of [0, total) is its probability to ~1e-16 (float32 would shift a token's mass by up to ~6e-8,
    the size of a rare token's probability). A zero-probability token is never drawn: its interval
    is empty (`right=True` skips ties)."""
    u = torch.rand((probs.shape[0],), dtype=torch.float64, device=probs.device, generator=generator)
    return inverse_cdf(probs, u)


class PromptStreams:
    """One random stream per prompt, for sampling whose outcome for a prompt does not depend on
    which other prompts share its batch: an engine given a `PromptStreams` instead of a generator
    draws each decoding step's uniform numbers for prompt j's `n` rows from stream j alone (one
    number per row per step, finished rows included), so a group sampled alone, or in any batch, in
    any process, gets the same quantiles. The data-parallel driver seeds stream j from (seed, step,
    global group index), which makes a run's samples independent of the world size
    (docs/distributed.md)."""

    def __init__(self, seeds: list[int], device: str | torch.device = "cpu"):
        self.seeds = [int(s) for s in seeds]            # what a rollout server is sent to rebuild them
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in self.seeds]

    def __len__(self) -> int:
        return len(self.generators)

    def uniforms(self, n: int) -> torch.Tensor:
        """The next step's numbers: [len(self) * n], prompt after prompt (the engines' row order)."""
        return torch.cat([torch.rand((n,), dtype=torch.float64, generator=g) for g in self.generators])


def mix_seed(*values: int) -> int:
    """A 62-bit seed from integers, in order (splitmix64's finaliser over each): the seed of a
    stream derived from another's (an episode's turn from its group's stream)."""
    x = 0
    for v in values:
        x = (x + (int(v) & (2**64 - 1)) + 0x9E3779B97F4A7C15) & (2**64 - 1)
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        x ^= x >> 31
    return x >> 2


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The token of each row of `probs` [B, V] at quantile u [B] (in [0, 1)) of its distribution:
    the first token whose cumulative mass exceeds u * total.

    In two levels, so that no float64 copy of the whole [B, V] is made (a cumulative sum over a
    49,152-entry vocabulary in float64 took a tenth of a small model's decoding step): the mass of
    each block of `block` tokens (summed in float64), the block holding the quantile, then the
    cumulative mass inside that block alone. Up to float64 summation order this is the cumulative
    sum over the whole row."""
    B, V = probs.shape
    u = u.double()
    nb = V // block
    if nb < 2:
        cdf = torch.cumsum(probs, -1, dtype=torch.float64)
        return _first_over(cdf, u * cdf[:, -1], probs)
    head = probs[:, :nb * block].reshape(B, nb, block).sum(-1, dtype=torch.float64)     # [B, nb]
    if V > nb * block:
        head = torch.cat([head, probs[:, nb * block:].sum(-1, dtype=torch.float64)[:, None]], -1)
    cum = head.cumsum(-1)                                                               # [B, blocks]
    target = u * cum[:, -1]
    b = _first_over(cum, target, head)                                                  # [B] the block
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum], -1).gather(-1, b[:, None]).squeeze(-1)
    cols = b[:, None] * block + torch.arange(block, device=probs.device)[None]          # [B, block]
    part = probs.gather(-1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0)           # [B, block]
    return b * block + _first_over(part.cumsum(-1, dtype=torch.float64), target - before, part)


def _first_over(cum: torch.Tensor, target: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative mass `cum` [B, n] exceeds `target` [B] (zero entries of
    `mass` are never chosen); a target at or past the total (rounding) gives the last entry with
    mass."""
    tok = torch.searchsorted(cum, target[:, None], right=True).squeeze(-1)             # [B]
    over = tok >= mass.shape[-1]
    if over.any():
        last = mass.shape[-1] - 1 - (mass[over].flip(-1) > 0).long().argmax(-1)
        tok = tok.masked_scatter(over, last)
    return tok


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """The sub-batch of `rows` (in that order)."""
    idx = torch.tensor(rows, dtype=torch.long)
    L = max(int(batch.completion_mask[idx].sum(-1).max()), 1) if rows else 1
    return RolloutBatch([batch.prompt_ids[r] for r in rows], batch.completion_ids[idx, :L],
                        batch.completion_mask[idx, :L], batch.sampler_logprobs[idx, :L],
                        [batch.finish_reason[r] for r in rows], [batch.completions[r] for r in rows],
                        batch.resampled, batch.weights_version)


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack batches row-wise, right-padding completions to the longest."""
    L = max(b.completion_ids.shape[1] for b in batches)

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, L - t.shape[1]), value=value)

    return RolloutBatch(
        [p for b in batches for p in b.prompt_ids],
        torch.cat([pad(b.completion_ids, pad_id) for b in batches]),
        torch.cat([pad(b.completion_mask, 0) for b in batches]),
        torch.cat([pad(b.sampler_logprobs, 0.0) for b in batches]),
        [f for b in batches for f in b.finish_reason], [c for b in batches for c in b.completions],
        sum(b.resampled for b in batches), _oldest([b.weights_version for b in batches]))


def _oldest(versions: list[int | None]) -> int | None:
    """The oldest weights version of several batches (None when any is unknown)."""
    return None if any(v is None for v in versions) else min(versions)
