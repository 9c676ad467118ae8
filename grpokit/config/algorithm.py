"""Config sections `algorithm` (with `algorithm.kl`, `algorithm.sample_filter`, `algorithm.rewrite`)
and `optim`: advantages, loss, KL and the optimizer."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpokit._names import did_you_mean
from grpokit.config.base import AdvantageName, AggregationName, ControllerName, KLKindName, _Section, check_failed


class KLConfig(_Section):
    beta: float = Field(0.02, ge=0)
    """KL coefficient (initial value for adaptive controllers). 0 = no reference model."""
    estimator: KLKindName = "k3"
    """Per-token KL estimator, a name in `grpokit.algo.kl.KINDS`: k1, k2, k3, k3_is, or one added
    with `register_kind` (docs/algorithms.md says which gradient each gives)."""
    controller: ControllerName = "adaptive"
    """How beta changes during training, a name in `grpokit.algo.control.CONTROLLERS`: fixed,
    adaptive, ziegler, warmup, schedule, or one added with `register_controller`."""
    target_unit: Literal["sequence", "token"] = "sequence"
    """What the controller's KL target is measured in: `sequence`, the KL of a whole completion
    (Σ over its tokens, averaged over completions: `kl/ref_seq`), or `token`, the per-token mean
    (`kl/ref`). The practitioner's target of 1-10 only makes sense per completion: a per-token KL
    of 1 nat means the policy has left the reference entirely (docs/algorithms.md, "KL target")."""
    target_low: float = Field(1.0, ge=0)
    """Adaptive controller: lower beta when the observed KL (in `target_unit`) is below this."""
    target_high: float = Field(10.0, gt=0)
    """Adaptive controller: raise beta when the observed KL (in `target_unit`) is above this.
    Bigger models want a smaller target (the rule: "1~10, smaller for bigger models")."""

    @model_validator(mode="after")
    def _band(self):
        if self.target_low > self.target_high:
            raise ValueError(f"target_low {self.target_low:g} > target_high {self.target_high:g} "
                             f"(the band is in nats per {self.target_unit}: per completion by default)")
        if self.controller == "warmup" and self.warmup_steps:
            raise ValueError("algorithm.kl.warmup_steps adds a warm-up to a controller; the warmup controller "
                             "is one already: set one or the other")
        return self
    adapt_factor: float = Field(1.05, gt=1)
    """Adaptive controller: beta is multiplied (divided) by this after each step whose KL is above
    (below) the band. PPO's band rule uses 2 per policy iteration; applied at every GRPO step, 1.5
    raised beta from 0.02 to its cap of 10 in 25 steps on the demo task and held-out accuracy
    collapsed from 68% to 16%, where 1.05 kept learning (docs/variants.md)."""
    controller_args: dict[str, Any] = {}
    """Extra arguments for the controller (see grpokit.algo.control)."""
    warmup_steps: int | None = Field(None, ge=0)
    """KL warm-up (the practitioner's rule R2: a larger beta for the first ~1000 steps): beta is held
    at `warmup_scale` x `beta` for this many steps, the controller not stepped, then the controller
    takes over from `beta` (the step is logged). None (default): a tenth of `train.steps`, at most
    1000 (the rule's 1000 steps are a tenth of the runs it comes from), before a controller that
    aims at a KL (adaptive, ziegler); none for `fixed` (fixed means fixed) and `schedule` unless
    set here, none for `warmup` (it is one). A resumed run keeps the length it started with. 0 = no
    warm-up."""
    warmup_scale: float = Field(4.0, ge=1)
    """beta during the warm-up, as a multiple of `beta`: 4 turns 0.02 into 0.08, inside the rule's
    0.05-0.1."""
    measure_every: int = Field(10, ge=0)
    """With beta = 0 (no KL term): still measure KL to the reference every N steps, on up to
    `measure_rows` completions of the step's batch (`kl/ref`, `kl/ref_seq`), so the KL signal, the
    KL-climbing alarm and the reference integrity probe keep working; the reference is kept for it
    (free with LoRA: the adapters switched off; a frozen copy otherwise). 0 = not measured, and no
    reference at beta = 0."""
    measure_rows: int = Field(16, ge=1)
    """Completions the beta = 0 measurement runs on (two forward passes, no backward)."""
    in_reward: bool = False
    """Put the (detached, k1) KL into the reward instead of the loss."""
    ref_dropout: float = Field(0.0, ge=0, lt=1)
    """Reference dropout (practitioner's rule "Dr. GRPO as practised"): dropout on the reference's
    hidden states when computing KL."""
    ref_device: Literal["same", "cpu", "swap"] = "same"
    """Where a separate reference copy lives (practitioner's rule "memory order"): `same` device as
    the policy; `cpu` (kept and run on the CPU); `swap` (kept on the CPU, moved to the policy's
    device for each reference pass). Ignored for LoRA, whose reference is the policy with its
    adapters off (no copy)."""
    ref_cache: int | Literal["auto"] = "auto"
    """Cache up to this many per-sample reference log-prob vectors keyed by (prompt, completion)
    token ids, so repeated samples (identical completions in a group, a prompt answered the same
    way again) are not recomputed (practitioner's rule "LoRA-GRPO": pre-cached reference
    log-probs). `auto` (default): 4096 entries, let go after the first 10 reference passes if
    under 5% of the samples were hits (long, varied completions never repeat, and the cache would
    only hold memory); a number: that many, kept; 0 = off. Off when ref_dropout > 0."""

    @field_validator("ref_cache")
    @classmethod
    def _cache_size(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError(f"algorithm.kl.ref_cache must be >= 0 or auto, got {v}")
        return v


class FilterConfig(_Section):
    max_length: int | None = None
    """Drop completions longer than this many tokens from the loss."""
    drop_truncated: bool = False
    """Drop completions cut at max_new_tokens."""
    drop_duplicates: bool = False
    """Drop repeated identical completions within a group (the first is kept)."""
    format_reward: str | None = None
    """Drop samples scoring <= 0 on this reward function (a format check; one of `rewards`)."""
    drop_nonfinite: bool = True
    """Drop samples whose reward could not be computed."""
    score_threshold: float | None = Field(None, gt=0)
    """The combined proxy score (grpokit.data.filters.ProxyScore): drop a sample when the weighted
    sum of its proxies (truncated, length, format, duplicate, uninformative) reaches this. The
    uninformative term is a completion above its group's mean reward that is degenerate (repeated
    spans, tags around nothing, an answer without work). None (default) = off; 1.0 with the
    default weights drops one strong sign or two weak ones. Logged as `filter/score_mean`,
    `filter/dropped_score`, `filter/uninformative`."""
    weights: dict[str, float] = {"truncated": 0.5, "length": 0.5, "format": 0.5, "duplicate": 0.25,
                                 "uninformative": 1.5}
    """Weight of each proxy in the combined score (a proxy left out weighs 0)."""
    min_work_words: int = Field(0, ge=0)
    """A rewarded completion showing fewer words than this outside its markup and final answer counts
    as uninformative ("answer without work"). 0 = not checked: on tasks answered in one line
    (arithmetic) a bare answer is the right one."""

    @model_validator(mode="after")
    def _weights(self):
        from grpokit.data.filters import PROXIES

        for k, v in self.weights.items():
            if k not in PROXIES:
                raise check_failed(f"algorithm.sample_filter.weights: unknown proxy '{k}' (proxies: "
                                   f"{', '.join(PROXIES)}){did_you_mean(k, PROXIES)}")
            if not (v >= 0 and math.isfinite(v)):
                raise check_failed(f"algorithm.sample_filter.weights.{k} must be a finite number >= 0, got {v}")
        return self


class RewriteConfig(_Section):
    enabled: bool = False
    """Wrong-answer rewriting (grpokit.data.rewrite): wrong completions become teaching sequences."""
    weight: float = Field(0.1, ge=0)
    """Weight of the auxiliary likelihood term on the rewritten note."""
    template: str = "\nThat is wrong: {why}."
    """Note appended to a wrong completion. `{why}`: the first reward's diagnosis of it (math: the
    value given against the expected one; code: the failing test and its error), or "the verified
    answer differs" when that reward has none; `{answer}`: the reference answer (rows without one
    are then skipped)."""
    answer_template: str = " The answer is {answer}."
    """Appended to the note when the row has a reference answer and `template` does not use it."""
    max_per_step: int = Field(16, ge=1)
    """Rewritten sequences per step at most (with several processes, each rank writes up to its
    share, rounded up)."""

    @field_validator("template", "answer_template")
    @classmethod
    def _placeholders(cls, v: str, info):
        import string

        try:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"algorithm.rewrite.{info.field_name}: {e} (write a literal brace as {{{{ or }}}})") from None
        allowed = {"why", "answer"} if info.field_name == "template" else {"answer"}
        bad = sorted(names - allowed)
        if bad:
            raise ValueError(f"algorithm.rewrite.{info.field_name}: unknown placeholder {{{bad[0]}}} "
                             f"(it may use {', '.join('{' + a + '}' for a in sorted(allowed))})")
        return v


class AlgorithmConfig(_Section):
    advantage: AdvantageName = "grpo"
    """Advantage estimator, a name in `grpokit.algo.advantages.ESTIMATORS`: grpo, dr_grpo, rloo,
    sign, reinforce_pp_baseline, batch_std, opo, or one added with `register_estimator`."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    length_buckets: list[float] | None = None
    """Length-bucketed baselines: bucket edges (tokens, or quantiles in (0,1) with bucket_mode)."""
    bucket_mode: Literal["tokens", "quantiles"] = "tokens"
    """Whether `length_buckets` are token counts or quantiles of each group's lengths."""
    loss_agg: AggregationName = "token_mean"
    """Loss aggregation, a name in `grpokit.algo.loss.AGGREGATIONS` (token_mean = DAPO,
    seq_mean_token_mean = GRPO paper, seq_mean_token_sum_norm = Dr. GRPO with max_new_tokens as the
    constant, or one added with `register_aggregation`)."""
    eps_low: float = Field(0.2, ge=0)
    """Lower clip range: ratio >= 1 - eps_low."""
    eps_high: float = Field(0.2, ge=0)
    """Upper clip range: ratio <= 1 + eps_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """`sequence` = GSPO's length-normalised sequence ratio."""
    mu: int = Field(1, ge=1)
    """Policy updates (passes) per rollout batch. With mu = 1 and one mini-batch the old log-probs
    are the current ones, detached (no extra forward pass)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the rollout batch is split into this many mini-batches."""
    mask_truncated: bool = False
    """Overlong filtering (DAPO): truncated completions get no loss."""
    kl: KLConfig = KLConfig()
    """KL penalty to the frozen reference."""
    sample_filter: FilterConfig = FilterConfig()
    """Proxy-based sample filtering (practitioner's rule "Dr. GRPO as practised")."""
    rewrite: RewriteConfig = RewriteConfig()
    """Wrong-answer rewriting (practitioner's rule "Dr. GRPO as practised")."""
    entropy_coef: float = Field(0.0, ge=0)
    """An entropy bonus: minus this times the policy's entropy (over the vocabulary, at each
    completion token, aggregated like the surrogate by `loss_agg`) is added to the loss, logged as
    `loss/entropy_bonus`. Off by default; the entropy-collapse alarm's remedy (docs/metrics.md):
    0.001-0.01 holds entropy up, larger values trade reward for randomness."""
    entropy_target: float | None = Field(None, gt=0)
    """Adaptive entropy control (Skywork-OR1's, He et al. 2025, arXiv 2505.22312 §3.2.3; the
    entropy-collapse alarm's remedy kept on): a target for `policy/entropy` in nats per token. After
    each step the coefficient c moves by `entropy_coef_step`, up while the entropy is below the
    target and down otherwise, within [0, `entropy_coef_max`], starting from `entropy_coef`; the
    bonus acts (coefficient c) only on steps whose previous entropy was at or below the target.
    Logged as `policy/entropy_coef`. None = the coefficient stays `entropy_coef`."""
    entropy_coef_step: float = Field(0.0005, gt=0)
    """Adaptive entropy control: the coefficient's change per step."""
    entropy_coef_max: float = Field(0.01, gt=0)
    """Adaptive entropy control: the coefficient's ceiling."""
    pass_threshold: float = 1.0
    """A completion passes (for pass@1, curriculum and rewriting) when the first reward is >= this."""

    @model_validator(mode="after")
    def _combinations(self):
        if self.entropy_target is not None and self.entropy_coef > self.entropy_coef_max:
            raise check_failed(f"algorithm.entropy_coef {self.entropy_coef:g} is above entropy_coef_max "
                               f"{self.entropy_coef_max:g} (adaptive entropy control starts from entropy_coef)")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise check_failed("algorithm.dual_clip must be > 1")
        if self.length_buckets is not None and self.bucket_mode == "quantiles":
            if not all(0 < q < 1 for q in self.length_buckets):
                raise check_failed("algorithm.length_buckets must lie in (0, 1) with bucket_mode=quantiles")
        return self

    def check_config(self, cfg) -> None:
        fmt = self.sample_filter.format_reward
        names = [r.name for r in cfg.rewards]
        if fmt is not None and fmt not in names:
            raise check_failed(f"algorithm.sample_filter.format_reward '{fmt}' is not one of the rewards "
                               f"({', '.join(names)}){did_you_mean(fmt, names)}")


class OptimConfig(_Section):
    lr: float = Field(3e-6, gt=0)
    """AdamW learning rate (starting values: 3e-6 full fine-tune, 1e-4 to 2e-4 LoRA)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward (gradient accumulation makes up the mini-batch)."""
    logprob_chunk: int = Field(1024, ge=1)
    """Tokens per chunk when computing log-probs from hidden states (bounds logits memory)."""
