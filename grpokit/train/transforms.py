"""Batch transforms: what the variants do between scoring and the advantages, one named object each.

`build_transforms(cfg, ...)` returns the run's list, in the order they apply; the driver calls
each in turn and knows nothing of what they do. Dynamic sampling is the one transform that acts
while the batch is collected (it decides which groups are kept and whether to sample more), so it
is applied per generation round; the others see the collected batch.

| transform            | variant (docs/variants.md)          | effect on the batch                          |
|----------------------|-------------------------------------|----------------------------------------------|
| dynamic_sampling     | DAPO dynamic sampling (Yu et al. 2025, Eq. 11) | drop groups whose rewards are all equal |
| overlong_mask        | DAPO overlong filtering             | loss_mask 0 on truncated completions        |
| proxy_filter         | Dr. GRPO proxy-based filtering      | dropped rows: reward NaN, loss_mask 0        |
| curriculum           | curriculum sampling                 | records pass rates; lifts the bar            |
| wrong_answer_rewrite | wrong-answer rewriting              | adds the rewriting term's sequences          |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from grpokit.data.curriculum import Curriculum
from grpokit.data.filters import ProxyRules, ProxyScore, proxy_filter, proxy_scores, zero_variance_groups
from grpokit.data.rewrite import rewrite_sequences
from grpokit.train.batch import Batch, select


@dataclass
class StepContext:
    step: int                                        # training steps completed before this one
    metrics: dict[str, float] = field(default_factory=dict)   # what the transforms report


class Transform(Protocol):
    name: str

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch: ...


def passed(batch: Batch, reward_name: str, threshold: float) -> list[bool]:
    """Per completion: the named reward function's score reached `threshold`."""
    return [v is not None and math.isfinite(v) and v >= threshold for v in batch.scores[reward_name]]


class DynamicSampling:
    """Keep only groups whose rewards are not all equal (they carry no advantage signal), at most
    `want` groups; the driver samples more prompts while fewer are kept. With `reward_name`, a group
    must instead hold completions that pass that reward at `threshold` and completions that do not
    (DAPO's Eq. 11); completions without a total reward count in neither."""

    name = "dynamic_sampling"

    def __init__(self, reward_name: str | None = None, threshold: float = 1.0):
        self.reward_name, self.threshold = reward_name, threshold

    def __call__(self, batch: Batch, ctx: StepContext, want: int | None = None) -> Batch:
        values = batch.rewards.tolist()
        if self.reward_name is not None:
            ok = passed(batch, self.reward_name, self.threshold)
            values = [float(p) if math.isfinite(v) else v for p, v in zip(ok, values)]
        flat = zero_variance_groups(values, batch.group_id.tolist())
        keep = set([g for g, z in flat.items() if not z][:want])
        return select(batch, [i for i, g in enumerate(batch.group_id.tolist()) if g in keep])


class OverlongMask:
    """Truncated completions (finish_reason "length") carry no loss."""

    name = "overlong_mask"

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        rows = [i for i, f in enumerate(batch.finish_reason) if f == "length"]
        if rows:
            batch.loss_mask[rows] = 0
        return batch


class ProxyFilter:
    """Samples that cheap proxies mark as noise leave the loss and the group statistics: any single
    proxy of `rules`, or, with `score`, the combined proxy score at its threshold."""

    name = "proxy_filter"

    def __init__(self, rules: ProxyRules, score: ProxyScore | None = None, max_new_tokens: int = 0):
        self.rules, self.score, self.max_new_tokens = rules, score, max_new_tokens

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        kw = dict(completions=batch.completions, lengths=batch.lengths.tolist(), finish_reason=batch.finish_reason,
                  rewards=batch.rewards.tolist(), group_ids=batch.group_id.tolist(), per_fn=batch.scores)
        dropped = proxy_filter(self.rules, **kw)
        rows = [i for i, why in enumerate(dropped) if why is not None]
        if self.score is not None:
            scores = proxy_scores(self.score, max_new_tokens=self.max_new_tokens, **kw)
            by_score = [i for i, p in enumerate(scores) if p["score"] >= self.score.threshold and dropped[i] is None]
            rows = sorted(rows + by_score)
            ctx.metrics["filter/dropped_score"] = float(len(by_score))
            ctx.metrics["filter/score_mean"] = sum(p["score"] for p in scores) / max(len(scores), 1)
            ctx.metrics["filter/uninformative"] = float(sum(p["uninformative"] >= 0.5 for p in scores))
        if rows:
            batch.rewards[rows] = float("nan")
            batch.loss_mask[rows] = 0
        ctx.metrics["filter/dropped"] = float(len(rows))
        return batch


class CurriculumUpdate:
    """Record each prompt's pass rate in its group, for the curriculum's next choices: every group
    the step sampled (`sampled()`: the collector's scored rounds, before dynamic sampling keeps only
    mixed groups, which would pull the running pass rate to 1/2 whatever the policy does), else the
    batch's. With several ranks (`comm`), every rank observes every rank's groups, in rank order, so
    that all of them hold the same statistics and draw the same global prompt list."""

    name = "curriculum"

    def __init__(self, curriculum: Curriculum, reward_name: str, threshold: float, comm=None,
                 sampled: Callable[[], list[Batch]] | None = None):
        self.curriculum, self.reward_name, self.threshold, self.comm = curriculum, reward_name, threshold, comm
        self.sampled = sampled

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        groups, n_pass, n = [], 0, 0
        for b in (self.sampled() if self.sampled is not None else []) or [batch]:
            ok = passed(b, self.reward_name, self.threshold)
            groups += [(int(b.prompt_index[rows[0]]), sum(ok[i] for i in rows) / len(rows)) for rows in b.group_rows()]
            n_pass, n = n_pass + sum(ok), n + len(ok)
        local = (groups, n_pass, n)
        every = self.comm.gather(local) if self.comm is not None and self.comm.world > 1 else [local]
        for rank_groups, _, _ in every:
            for idx, rate in rank_groups:
                self.curriculum.observe(idx, rate)
        n_pass, n = sum(e[1] for e in every), sum(e[2] for e in every)
        if n:
            self.curriculum.observe_step(n_pass / n)
        ctx.metrics.update(self.curriculum.metrics(ctx.step + 1))   # the bar the next step draws under
        return batch


class WrongAnswerRewrite:
    """Wrong completions become teaching sequences that say why they are wrong (grpokit.data.rewrite).
    `diagnose(batch, rows)`: the first reward's diagnosis of those rows (None each: no diagnosis)."""

    name = "wrong_answer_rewrite"

    def __init__(self, tokenizer, reward_name: str, threshold: float, *, template: str, answer_template: str,
                 limit: int, diagnose: Callable[[Batch, list[int]], list[str | None]] | None = None):
        self.tokenizer, self.reward_name, self.threshold = tokenizer, reward_name, threshold
        self.template, self.answer_template, self.limit, self.diagnose = template, answer_template, limit, diagnose

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        ok = passed(batch, self.reward_name, self.threshold)
        answers = [row.get("answer") for row in batch.rows]
        scores = batch.scores[self.reward_name]
        # known wrong: scored (finite) and under the threshold; a sample the reward could not score is not
        wrong = [i for i, p in enumerate(ok) if not p and scores[i] is not None and math.isfinite(scores[i])]
        rows = wrong[: self.limit * 2]          # room for rows that get no note
        why = self.diagnose(batch, rows) if self.diagnose is not None and rows else [None] * len(rows)
        completions = [batch.completion_ids[i][batch.mask[i].bool()].tolist() for i in rows]
        used: list[int] = []
        batch.rewrites = rewrite_sequences(self.tokenizer, [batch.prompt_ids[i] for i in rows], completions,
                                           [answers[i] for i in rows], [True] * len(rows), template=self.template,
                                           answer_template=self.answer_template, why=why, limit=self.limit,
                                           used=used)
        ctx.metrics["rewrite/sequences"] = float(len(used))
        ctx.metrics["rewrite/diagnosed"] = float(sum(why[k] is not None for k in used))
        return batch


def build_transforms(cfg, *, tokenizer: Any, curriculum: Curriculum | None,
                     diagnose: Callable[[Batch, list[int]], list[str | None]] | None = None,
                     comm=None, sampled: Callable[[], list[Batch]] | None = None) -> list[Transform]:
    """The run's transforms after collection, in order (dynamic sampling is `DynamicSampling`,
    applied by the driver per generation round when `rollout.dynamic_sampling`). `diagnose`: why
    rows of a batch fail the first reward (`Collector.diagnose`), for wrong-answer rewriting.
    `comm`: the job's collectives (the curriculum's statistics are shared over ranks); `sampled`:
    every group the step sampled (`Collector.take_scored`), for the curriculum."""
    a = cfg.algorithm
    first, thr = cfg.rewards[0].name, a.pass_threshold
    out: list[Transform] = []
    if a.mask_truncated:
        out.append(OverlongMask())
    f = a.sample_filter
    score = (ProxyScore(threshold=f.score_threshold, weights=dict(f.weights), max_length=f.max_length,
                        format_reward=f.format_reward, min_work_words=f.min_work_words)
             if f.score_threshold is not None else None)
    out.append(ProxyFilter(ProxyRules(max_length=f.max_length, drop_truncated=f.drop_truncated,
                                      drop_duplicates=f.drop_duplicates, format_reward=f.format_reward,
                                      drop_nonfinite=f.drop_nonfinite),
                           score, cfg.rollout.max_new_tokens))
    if curriculum is not None:
        out.append(CurriculumUpdate(curriculum, first, thr, comm, sampled))
    if a.rewrite.enabled:
        world = comm.world if comm is not None else 1     # the step's limit, shared over the ranks
        out.append(WrongAnswerRewrite(tokenizer, first, thr, template=a.rewrite.template,
                                      answer_template=a.rewrite.answer_template,
                                      limit=max(1, -(-a.rewrite.max_per_step // world)), diagnose=diagnose))
    return out


def rewards_tensor(total: list) -> torch.Tensor:
    """[B] float64 rewards, NaN where a completion could not be scored."""
    return torch.tensor([float("nan") if v is None else float(v) for v in total], dtype=torch.float64)
