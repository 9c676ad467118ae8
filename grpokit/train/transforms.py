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
| curriculum           | curriculum sampling                 | records each prompt's pass rate              |
| wrong_answer_rewrite | wrong-answer rewriting              | adds the rewriting term's sequences          |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from grpokit.data.curriculum import Curriculum
from grpokit.data.filters import ProxyRules, proxy_filter, zero_variance_groups
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
    """Samples that cheap proxies mark as noise leave the loss and the group statistics."""

    name = "proxy_filter"

    def __init__(self, rules: ProxyRules):
        self.rules = rules

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        dropped = proxy_filter(self.rules, completions=batch.completions, lengths=batch.lengths.tolist(),
                               finish_reason=batch.finish_reason, rewards=batch.rewards.tolist(),
                               group_ids=batch.group_id.tolist(), per_fn=batch.scores)
        rows = [i for i, why in enumerate(dropped) if why is not None]
        if rows:
            batch.rewards[rows] = float("nan")
            batch.loss_mask[rows] = 0
        ctx.metrics["filter/dropped"] = float(len(rows))
        return batch


class CurriculumUpdate:
    """Record each prompt's pass rate in its group, for the curriculum's next choices."""

    name = "curriculum"

    def __init__(self, curriculum: Curriculum, reward_name: str, threshold: float):
        self.curriculum, self.reward_name, self.threshold = curriculum, reward_name, threshold

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        ok = passed(batch, self.reward_name, self.threshold)
        for rows in batch.group_rows():
            self.curriculum.observe(int(batch.prompt_index[rows[0]]), sum(ok[i] for i in rows) / len(rows))
        return batch


class WrongAnswerRewrite:
    """Wrong completions with a known answer become teaching sequences (grpokit.data.rewrite)."""

    name = "wrong_answer_rewrite"

    def __init__(self, tokenizer, reward_name: str, threshold: float, *, template: str, limit: int):
        self.tokenizer, self.reward_name, self.threshold = tokenizer, reward_name, threshold
        self.template, self.limit = template, limit

    def __call__(self, batch: Batch, ctx: StepContext) -> Batch:
        ok = passed(batch, self.reward_name, self.threshold)
        completions = [c[m.bool()].tolist() for c, m in zip(batch.completion_ids, batch.mask)]
        batch.rewrites = rewrite_sequences(self.tokenizer, batch.prompt_ids, completions,
                                           [row.get("answer") for row in batch.rows], [not p for p in ok],
                                           template=self.template, limit=self.limit)
        return batch


def build_transforms(cfg, *, tokenizer: Any, curriculum: Curriculum | None) -> list[Transform]:
    """The run's transforms after collection, in order (dynamic sampling is `DynamicSampling`,
    applied by the driver per generation round when `rollout.dynamic_sampling`)."""
    a = cfg.algorithm
    first, thr = cfg.rewards[0].name, a.pass_threshold
    out: list[Transform] = []
    if a.mask_truncated:
        out.append(OverlongMask())
    out.append(ProxyFilter(ProxyRules(**a.sample_filter.model_dump())))
    if curriculum is not None:
        out.append(CurriculumUpdate(curriculum, first, thr))
    if a.rewrite.enabled:
        out.append(WrongAnswerRewrite(tokenizer, first, thr, template=a.rewrite.template, limit=a.rewrite.max_per_step))
    return out


def rewards_tensor(total: list) -> torch.Tensor:
    """[B] float64 rewards, NaN where a completion could not be scored."""
    return torch.tensor([float("nan") if v is None else float(v) for v in total], dtype=torch.float64)
