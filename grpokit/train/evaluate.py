"""Held-out evaluation: the checker that scores it (independent of the training reward where it can
be), greedy pass@1 and, optionally, sampled mean@k."""

from __future__ import annotations

import logging
import math

import torch

from grpokit.rollout.base import NonFiniteLogits, SamplingParams
from grpokit.rollout.episodes.metrics import episode_columns

log = logging.getLogger("grpokit.train")


def _passes(values: list, threshold: float) -> list[bool]:
    return [v is not None and math.isfinite(v) and v >= threshold for v in values]


def build_checker(cfg, eval_dataset, *, say: bool = True, fns=None):
    """The held-out checker's RewardSet (`eval.checker`, grpokit.rewards.checker), its columns checked
    against the held-out rows; whether it is independent of the training rewards is logged (a
    warning when it is not). `fns`: name -> function of rewards no longer registered."""
    from grpokit.rewards import check_columns
    from grpokit.rewards.checker import choose_checker

    ch = choose_checker(cfg.eval.checker, cfg.eval.checker_args, cfg.rewards, eval_dataset.rows,
                        threshold=cfg.algorithm.pass_threshold, fns=fns)
    check_columns([{"name": ch.name, "args": ch.args}], eval_dataset.rows,
                  eval_dataset.source or "the held-out prompts", fns=fns)
    if say:
        (log.info if ch.independent else log.warning)(ch.describe())
    return ch.reward_set(fns)


@torch.no_grad()
def evaluate(engine, encoder, reward_set, dataset, cfg, *, samples: int = 0, generator=None,
             batch_prompts: int = 64, episodes=None) -> dict:
    """`eval/pass@1`: fraction of prompts whose greedy completion scores >= `algorithm.pass_threshold`
    on the first function of `reward_set` (the held-out checker, grpokit.rewards.checker);
    `eval/mean@k`: mean fraction over k sampled completions at the run's temperature. `episodes`: a
    multi-turn runner (grpokit.rollout.episodes) over `engine`, whose whole episodes are scored as
    in training.
    """
    threshold = cfg.algorithm.pass_threshold
    rows = dataset.rows[: cfg.data.eval_size or None]
    primary = reward_set.names[0]
    out = {}
    for k, temp in ((1, 0.0), (samples, cfg.rollout.temperature)):
        if k == 0:
            continue
        hits: list[bool] = []
        for s in range(0, len(rows), batch_prompts):
            chunk = rows[s:s + batch_prompts]
            ids = [encoder.encode(r["prompt"]) for r in chunk] if episodes is None else None
            params = SamplingParams(n=k, max_new_tokens=cfg.rollout.max_new_tokens, temperature=temp,
                                    top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
            batch = (episodes.run(chunk, params, generator) if episodes is not None
                     else engine.generate(ids, params, generator))
            keys = sorted({c for r in chunk for c in r if c != "prompt"})
            cols = {c: [r.get(c) for r in chunk for _ in range(k)] for c in keys}
            lengths = (batch.action_mask if batch.action_mask is not None else batch.completion_mask).sum(-1)
            cols.update(completion_length=lengths.tolist(), finish_reason=batch.finish_reason,
                        group_id=[g for g in range(len(chunk)) for _ in range(k)],
                        max_new_tokens=[cfg.rollout.max_new_tokens] * len(batch))
            if batch.episodes is not None:
                prompts, completions = episode_columns(episodes, batch.prompt_ids, batch.completions, batch.episodes, cols)
            else:
                prompts, completions = [encoder.text(r["prompt"]) for r in chunk for _ in range(k)], batch.completions
            res = reward_set.score(prompts, completions, cols)
            hits += _passes(res.per_fn[primary], threshold)
        name = "eval/pass@1" if temp == 0.0 else "eval/mean@k"
        out[name] = sum(hits) / max(len(hits), 1)
    return out


def held_out(engine, encoder, reward_set, dataset, cfg, *, seed: int, step: int, device="cpu", episodes=None) -> dict:
    """`evaluate` on its own random stream (evaluation never shifts training's); {} when the
    rollout met non-finite logits (the guard's business, not a reason to stop the run)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    try:
        return evaluate(engine, encoder, reward_set, dataset, cfg, samples=cfg.train.eval_samples, generator=gen,
                        episodes=episodes)
    except NonFiniteLogits as exc:
        log.warning("step %d: evaluation skipped: %s", step, exc)
        return {}
