"""The GRPO loop: sample -> reward -> advantages -> (reference / old log-probs) -> update -> monitor
-> checkpoint. One step of `Trainer.step` reads like DeepSeekMath's Algorithm 1 (inner loop):

  1. draw B prompts, sample G completions each with the current policy (pi_old = pi_theta);
  2. score every completion with the reward functions (a failing reward scores None -> excluded);
  3. group-relative advantages (grpokit.algo.advantages);
  4. reference log-probs once per batch (no_grad); old log-probs only when mu > 1 or the batch is
     cut into several mini-batches (otherwise the current log-probs, detached, are pi_old exactly);
  5. mu passes of clipped-surrogate + beta * KL updates over length-grouped micro-batches, whose
     losses sum exactly to the whole mini-batch's loss (token counts passed in);
  6. metrics, alarms, samples, checkpoints.

Departures from the paper: the KL coefficient may change between steps (a controller), and samples
with zero advantage skip the forward pass when they cannot contribute a gradient (beta = 0); they
still count in the loss normaliser, so the gradient is unchanged.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpokit.algo import advantages as adv_lib
from grpokit.algo import kl as kl_lib
from grpokit.algo import loss as loss_lib
from grpokit.algo.control import build_controller
from grpokit.config import Config, dump_config
from grpokit.monitor.sinks import atomic_write_text, open_sink, truncate_jsonl
from grpokit.data.curriculum import Curriculum
from grpokit.data.filters import ProxyRules, proxy_filter, zero_variance_groups
from grpokit.data.rewrite import rewrite_sequences
from grpokit.rollout.base import NonFiniteLogits, RolloutBatch, SamplingParams, concat_batches, select_rows
from grpokit.rollout.hf import HFEngine
from grpokit.train import checkpoint as ckpt_lib
from grpokit.train.dropout import hidden_dropout
from grpokit.train.evaluate import evaluate
from grpokit.train.guard import NonFiniteStep, ReferenceDriftError, diagnose
from grpokit.train import forward as lean_forward
from grpokit.train.logprobs import (MicroBatch, build_micro_batch, completion_logprobs, padding_fraction,
                                    plan_micro_batches, unwrap)
from grpokit.train.model import frozen_copy
from grpokit.train.reference import RefLogprobCache, swapped_in
from grpokit.train.prompts import PromptEncoder

log = logging.getLogger("grpokit.train")


def build_kl_controller(cfg: Config):
    k = cfg.algorithm.kl
    if k.beta == 0:
        return build_controller("fixed", beta=0.0)
    args = dict(k.controller_args)
    if k.controller == "adaptive":
        args = {"low": k.target_low, "high": k.target_high, "factor": k.adapt_factor, **args}
    if k.controller in ("warmup", "schedule"):
        args.setdefault("inner", {"kind": "fixed", "beta": k.beta})
        if k.controller == "schedule":
            args.setdefault("total_steps", cfg.train.steps)
        return build_controller(k.controller, **args)
    return build_controller(k.controller, beta=k.beta, **args)


def _nanmean(vals) -> float:
    """Mean with NaNs ignored; NaN (and no warning) when every value is NaN."""
    a = np.asarray(vals, dtype=float)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else float("nan")


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stack(per_row: dict[int, torch.Tensor], rows: list[int], L: int, dev) -> torch.Tensor:
    """[len(rows), L] from per-row log-prob vectors (each as long as its completion), zero-padded."""
    out = torch.zeros(len(rows), L, dtype=per_row[rows[0]].dtype)
    for k, r in enumerate(rows):
        v = per_row[r][:L]
        out[k, :len(v)] = v
    return out.to(dev)


def lr_lambda(cfg: Config, total: int):
    warm, kind = cfg.optim.warmup_steps, cfg.optim.schedule

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return f


def _num(v) -> float | None:
    return None if v is None else float(v)


_NOTHING_SEEN = (0.0, math.inf)   # (largest ratio, smallest log-prob) of a mini-batch, for the guard


@dataclass
class StepData:
    """Everything the update needs about one rollout batch."""
    rollout: RolloutBatch
    advantages: torch.Tensor                       # [N]
    loss_mask: torch.Tensor                        # [N, L] completion mask, truncated rows zeroed if asked
    ref_logp: dict[int, torch.Tensor] = field(default_factory=dict)   # row -> [L_row]
    old_logp: dict[int, torch.Tensor] = field(default_factory=dict)
    rewrites: tuple[list[list[int]], list[list[int]]] | None = None   # (contexts, note targets)
    rewards: torch.Tensor | None = None            # [N] the rewards behind the advantages (NaN = not scored)
    frac_zero_std: float | None = None             # share of groups whose rewards are all equal


def _diagnose(data: StepData, **found) -> str:
    """The non-finite guard's cause for a skipped update, with the step's rewards and zero-std share
    (the first two checks of the diagnosis order)."""
    return diagnose(rewards=data.rewards, frac_zero_std=data.frac_zero_std, **found)


@dataclass
class Scored:
    """Rewards of a batch: weighted totals (NaN = could not be scored) and each function's scores."""
    total: list[float]
    per_fn: dict[str, list]
    metrics: dict[str, float]

    @classmethod
    def of(cls, out) -> "Scored":
        total = [float("nan") if v is None else float(v) for v in out.total]
        return cls(total, {k: list(v) for k, v in out.per_fn.items()}, {k: float(v) for k, v in out.metrics.items()})

    def select(self, rows: list[int]) -> "Scored":
        return Scored([self.total[r] for r in rows], {k: [v[r] for r in rows] for k, v in self.per_fn.items()},
                      self.metrics)

    @classmethod
    def concat(cls, parts: list["Scored"]) -> "Scored":
        metrics: dict[str, float] = {}
        for k in parts[0].metrics:
            vals = [p.metrics.get(k, float("nan")) for p in parts]
            metrics[k] = float(np.nansum(vals)) if k.endswith("/errors") else _nanmean(vals)
        return cls([t for p in parts for t in p.total],
                   {k: [v for p in parts for v in p.per_fn[k]] for k in parts[0].per_fn}, metrics)


class Trainer:
    """GRPO-family trainer over a transformers causal LM. Build it with `grpokit.train.build_trainer`."""

    def __init__(self, cfg: Config, model, tokenizer, dataset, reward_set, *, eval_dataset=None,
                 reference=None, engine=None, health=None):
        """`reference`: a frozen model, the string "adapter_off" (a PEFT policy with its adapters
        disabled serves as the reference: no second copy of the weights), or None (a frozen copy
        of `model` is made when beta > 0)."""
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.dataset, self.eval_dataset, self.rewards = dataset, eval_dataset, reward_set
        self.run_dir = Path(cfg.train.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.encoder = PromptEncoder(tokenizer, cfg.data.chat_template)
        self.engine = engine or HFEngine(model, tokenizer)
        self.device = next(model.parameters()).device
        beta_used = cfg.algorithm.kl.beta > 0
        self.ref_adapter_off = reference == "adapter_off"
        if self.ref_adapter_off:
            reference = model
        self.reference = reference if reference is not None else (frozen_copy(model) if beta_used else None)
        from grpokit.data.datasets import PromptSampler
        self.sampler = PromptSampler(len(dataset), seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        total_opt = cfg.train.steps * cfg.algorithm.mu * cfg.algorithm.mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_opt))
        self.kl_ctl = build_kl_controller(cfg)
        self.gen = torch.Generator(device="cpu" if self.device.type == "cpu" else self.device)
        self.gen.manual_seed(cfg.train.seed)
        self.step_idx = 0
        self.health = health
        self.sink = open_sink(self.run_dir, cfg)
        self.skipped_steps = 0           # steps none of whose updates reached the weights
        self.skipped_minibatches = 0     # mini-batch updates (optimizer steps) the guard skipped
        self.rollbacks = 0
        self.consecutive_bad = 0
        self.bad_since_save = False
        self.ref_probe: tuple[list[MicroBatch], dict[int, torch.Tensor]] | None = None
        k = cfg.algorithm.kl
        self.ref_cache = RefLogprobCache(k.ref_cache) if (k.ref_cache and k.ref_dropout == 0) else None
        self.proxy_rules = ProxyRules(**cfg.algorithm.sample_filter.model_dump())
        cur = cfg.data.curriculum
        self.curriculum = (Curriculum(start=cur.start, end=cur.end, ramp_steps=cur.ramp_steps, pool_factor=cur.pool_factor,
                                      ema=cur.ema, prior=cur.prior, prior_field=cur.prior_field) if cur.enabled else None)
        self._last = None                # (rows, batch, rewards, advantages, scored) of the last step

    # ------------------------------------------------------------------ phases
    def sample(self, rows: list[dict]) -> RolloutBatch:
        r = self.cfg.rollout
        prompt_ids = [self.encoder.encode(row["prompt"]) for row in rows]
        params = SamplingParams(n=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                top_p=r.top_p, top_k=r.top_k, resample_threshold=r.resample_threshold,
                                ignore_eos=r.ignore_eos)
        return self.engine.generate(prompt_ids, params, self.gen)

    def score(self, rows: list[dict], batch: RolloutBatch):
        G = self.cfg.rollout.group_size
        keys = sorted({k for row in rows for k in row if k != "prompt"})
        columns = {k: [row.get(k) for row in rows for _ in range(G)] for k in keys}
        columns["completion_length"] = batch.lengths.tolist()
        columns["finish_reason"] = list(batch.finish_reason)
        columns["group_id"] = [i // G for i in range(len(batch))]
        columns["max_new_tokens"] = [self.cfg.rollout.max_new_tokens] * len(batch)
        prompts = [self.encoder.text(row["prompt"]) for row in rows for _ in range(G)]
        return self.rewards.score(prompts, batch.completions, columns)

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[MicroBatch]:
        totals = [len(batch.prompt_ids[i]) + int(batch.completion_mask[i].sum()) for i in rows]
        lean = lean_forward.supports(unwrap(self.model))     # prompts run once per micro-batch
        plan = plan_micro_batches(totals, self.cfg.optim.micro_batch_size,
                                  [batch.prompt_ids[i] for i in rows] if lean else None)
        return [build_micro_batch([rows[j] for j in mb], batch.prompt_ids, batch.completion_ids,
                                  batch.completion_mask, self.tokenizer.pad_token_id) for mb in plan]

    @torch.no_grad()
    def logprobs_of(self, model, mbs: list[MicroBatch], *, dropout: bool = False) -> dict[int, torch.Tensor]:
        out = {}
        was = model.training
        model.train(dropout)
        try:
            for mb in mbs:
                lp, _ = completion_logprobs(model, mb, temperature=self.cfg.rollout.temperature,
                                            chunk_tokens=self.cfg.optim.logprob_chunk)
                for k, r in enumerate(mb.rows.tolist()):
                    out[r] = lp[k, :int(mb.mask[k].sum())].detach()
        finally:
            model.train(was)
        return out

    def ref_logprobs(self, mbs: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """Reference log-probs: a frozen copy, or the policy with its adapters disabled."""
        p = self.cfg.algorithm.kl.ref_dropout
        if self.ref_adapter_off:
            with self.model.disable_adapter(), hidden_dropout(self.model, p):
                return self.logprobs_of(self.model, mbs)
        with hidden_dropout(self.reference, p), swapped_in(self.reference, self.device,
                                                           self.cfg.algorithm.kl.ref_device == "swap"):
            return self.logprobs_of(self.reference, mbs)

    def cached_ref_logprobs(self, batch: RolloutBatch, rows: list[int], mbs: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """Reference log-probs through the cache (`algorithm.kl.ref_cache`, seed 3.4): a sample with the
        same prompt and completion token ids as one seen before (or earlier in this batch) reuses them."""
        if self.ref_cache is None:
            return self.ref_logprobs(mbs)
        keys = {r: self.ref_cache.key(batch.prompt_ids[r], batch.completion_ids[r, :int(batch.completion_mask[r].sum())])
                for r in rows}
        return self.ref_cache.fetch(keys, lambda todo: self.ref_logprobs(self.micro_batches(batch, todo)))

    def check_reference(self, batch: RolloutBatch) -> float | None:
        """Reference integrity (seed 5.3). The first call records the reference's log-probs on a fixed
        probe batch (the first rows of this batch); every `guard.ref_check_every` steps they are
        recomputed. Returns the largest absolute change in nats (NaN when they stopped being finite),
        or None when nothing was checked. A change beyond `guard.ref_tolerance` is logged (the
        `ref_drift` alarm reads `ref/integrity_drift`) or, with `guard.ref_strict`, raised."""
        g = self.cfg.guard
        if self.reference is None or not g.ref_check_every:
            return None
        if self.ref_probe is None:
            mbs = self.micro_batches(batch, list(range(min(8, len(batch)))))
            self.ref_probe = (mbs, self._probe_logprobs(mbs))
            return 0.0
        if (self.step_idx + 1) % g.ref_check_every:
            return None
        mbs, base = self.ref_probe
        now = self._probe_logprobs(mbs)
        diffs = torch.cat([(now[r] - base[r].float().cpu()).abs() for r in base])   # every probe token
        drift = float(diffs.max()) if diffs.numel() else 0.0                   # max propagates NaN
        if not drift <= g.ref_tolerance:
            msg = (f"reference log-probs drifted by {drift:.3g} nats on the probe batch "
                   f"(tolerance {g.ref_tolerance:g})")
            if g.ref_strict:
                raise ReferenceDriftError(msg + ": the reference model changed (guard.ref_strict)")
            log.warning(msg)
        return drift

    def _probe_logprobs(self, mbs: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """The reference's log-probs on the probe, on the CPU; without reference dropout, which would
        make them random."""
        if self.ref_adapter_off:
            with self.model.disable_adapter():
                out = self.logprobs_of(self.model, mbs)
        else:
            out = self.logprobs_of(self.reference, mbs)
        return {r: v.float().cpu() for r, v in out.items()}

    def update(self, data: StepData, beta: float) -> dict:
        """mu passes over mini-batches. Losses are summed over the micro-batches of a mini-batch (they
        add up to the mini-batch loss) and averaged over mini-batches; per-token statistics are
        token-weighted. A mini-batch whose loss or gradient is not finite is skipped alone, with its
        cause in `self.bad_causes` (`_guard_after_update` counts it)."""
        cfg, a = self.cfg, self.cfg.algorithm
        N = len(data.rollout)
        need_kl_loss = beta > 0 and not a.kl.in_reward and self.reference is not None
        losses: dict[str, list[float]] = {}
        tok_sums: dict[str, float] = {}
        n_tok_seen, ratio_max, grad_norms, pads = 0, float("nan"), [], []
        rng = np.random.default_rng([cfg.train.seed, self.step_idx])
        for _epoch in range(a.mu):
            perm = rng.permutation(N) if a.mini_batches > 1 else np.arange(N)
            for mini in np.array_split(perm, a.mini_batches):
                mini = mini.tolist()
                n_tok = int(data.loss_mask[mini].sum())
                # rows that can move the gradient: non-zero advantage, or any row when KL is in the loss
                live = [i for i in mini if (need_kl_loss or float(data.advantages[i]) != 0.0)
                        and bool(data.loss_mask[i].any())]
                self.optimizer.zero_grad(set_to_none=True)
                mbs = self.micro_batches(data.rollout, live) if live else []
                mini_loss: dict[str, float] = {}
                try:
                    micro = [self._micro_step(mb, data, beta, need_kl_loss, n_tok, len(mini)) for mb in mbs]
                except NonFiniteStep as exc:   # the guard: nothing of this mini-batch reaches the weights
                    self.optimizer.zero_grad(set_to_none=True)
                    self._advance_schedule()
                    self.bad_causes.append(str(exc))
                    continue
                for st, ntok in micro:
                    for k in ("loss/policy", "loss/kl", "loss/total", "loss/token_mean"):
                        if k in st:
                            mini_loss[k] = mini_loss.get(k, 0.0) + st.pop(k)
                    ratio_max = st.pop("policy/ratio_max", ratio_max) if math.isnan(ratio_max) else max(
                        ratio_max, st.pop("policy/ratio_max", ratio_max))
                    for k, v in st.items():
                        tok_sums[k] = tok_sums.get(k, 0.0) + v * ntok
                    n_tok_seen += ntok
                if data.rewrites and _epoch == 0 and not losses.get("loss/rewrite"):
                    mini_loss["loss/rewrite"] = self._rewrite_step(data.rewrites)
                for k, v in mini_loss.items():
                    losses.setdefault(k, []).append(v)
                gn = self._optimizer_step(data, has_grad=bool(mbs) or "loss/rewrite" in mini_loss)
                grad_norms.append(gn)
                pads.append(padding_fraction(mbs) if mbs else 0.0)
        out = {k: float(np.mean(v)) for k, v in losses.items()}
        out.update({k: v / max(n_tok_seen, 1) for k, v in tok_sums.items()})
        out["policy/ratio_max"] = ratio_max
        out["optim/grad_norm"] = _nanmean(grad_norms)
        out["update/padding_frac"] = float(np.mean(pads)) if pads else 0.0
        return out

    def _rewrite_step(self, rewrites) -> float:
        """Wrong-answer rewriting's auxiliary term (grpokit.data.rewrite), added to the first
        optimizer step of the update: weight * token-mean NLL of the notes."""
        contexts, targets = rewrites
        if not contexts:
            return 0.0
        L = max(len(t) for t in targets)
        ids = torch.full((len(targets), L), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(targets), L), dtype=torch.long)
        for i, t in enumerate(targets):
            ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), 1
        n_tok, total = int(mask.sum()), 0.0
        for chunk in plan_micro_batches([len(c) + len(t) for c, t in zip(contexts, targets)], self.cfg.optim.micro_batch_size):
            mb = build_micro_batch(chunk, contexts, ids, mask, self.tokenizer.pad_token_id)
            logp, _ = completion_logprobs(self.model, mb, chunk_tokens=self.cfg.optim.logprob_chunk)
            loss = -self.cfg.algorithm.rewrite.weight * torch.where(mb.mask.to(logp.device).bool(), logp, 0.0).sum() / n_tok
            if torch.isfinite(loss):
                loss.backward()
                total += float(loss.detach())
        return total

    def _micro_step(self, mb: MicroBatch, data: StepData, beta: float, need_kl_loss: bool,
                    n_tok: int, n_seq: int) -> tuple[dict, int]:
        a = self.cfg.algorithm
        rows = mb.rows.tolist()
        dev = self.device
        logp, ent = completion_logprobs(self.model, mb, temperature=self.cfg.rollout.temperature,
                                        chunk_tokens=self.cfg.optim.logprob_chunk, want_entropy=True)
        L = logp.shape[1]
        mask = data.loss_mask[rows, :L].to(dev).to(logp.dtype)
        valid = logp.detach()[mask.bool()]
        adv = data.advantages[rows].to(dev, logp.dtype)
        if not torch.isfinite(valid).all():
            self._guard_seen = _NOTHING_SEEN
            raise NonFiniteStep(_diagnose(data, advantages=adv, logp_finite=False))
        old = _stack(data.old_logp, rows, L, dev) if data.old_logp else logp.detach()
        kw = dict(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, max_len=self.cfg.rollout.max_new_tokens,
                  ratio_level=a.ratio_level, num_tokens=n_tok, num_seqs=n_seq)
        pg, st = loss_lib.policy_loss(logp, old, adv, mask, agg=a.loss_agg, **kw)
        out = {"loss/policy": float(pg.detach())}
        if a.loss_agg == "token_mean":
            out["loss/token_mean"] = out["loss/policy"]
        else:  # the seed's "token-level loss" signal, whatever the aggregation
            with torch.no_grad():
                out["loss/token_mean"] = float(loss_lib.policy_loss(logp.detach(), old, adv, mask, agg="token_mean", **kw)[0])
        total = pg
        ntok = int(mask.sum())
        if need_kl_loss:
            ref = _stack(data.ref_logp, rows, L, dev)
            kl_tok = kl_lib.estimate(logp, ref, a.kl.estimator, old_logp=old)
            kl_loss = loss_lib.aggregate(kl_tok, mask, a.loss_agg, num_tokens=n_tok, num_seqs=n_seq,
                                         max_len=self.cfg.rollout.max_new_tokens)
            total = total + beta * kl_loss
            out["loss/kl"] = float(kl_loss.detach())
            out["kl/ref"] = float(torch.where(mask.bool(), kl_tok.detach(), 0.0).sum()) / max(ntok, 1)
        if not torch.isfinite(total.detach()):
            lp_min = float(valid.min()) if valid.numel() else None
            self._guard_seen = _NOTHING_SEEN
            raise NonFiniteStep(_diagnose(data, advantages=adv, ratio_max=_num(st.get("ratio_max")), logp_min=lp_min))
        # what the guard needs to name the cause if the gradient of this mini-batch overflows
        rm, lm = getattr(self, "_guard_seen", _NOTHING_SEEN)
        self._guard_seen = (max(rm, _num(st.get("ratio_max")) or 0.0),
                            min(lm, float(valid.min())) if valid.numel() else lm)
        total.backward()
        out["loss/total"] = float(total.detach())
        out["policy/entropy"] = float(torch.where(mask.bool(), ent, 0.0).sum()) / max(ntok, 1)
        for k in ("clip_frac_low", "clip_frac_high", "approx_kl", "ratio_max"):
            if k in st:
                out[f"policy/{'approx_kl_old' if k == 'approx_kl' else k}"] = float(st[k])
        return out, ntok

    def _advance_schedule(self) -> None:
        """A skipped update still advances the learning-rate schedule (it counts training steps),
        so torch's 'scheduler before optimizer' warning does not apply."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()

    def _optimizer_step(self, data: StepData, has_grad: bool) -> float:
        """Clip and apply the accumulated gradient; NaN (and nothing applied) when it is not finite."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not has_grad:
            self._advance_schedule()
            return 0.0
        gn = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.max_grad_norm)
        ratio_max, logp_min = getattr(self, "_guard_seen", _NOTHING_SEEN)
        self._guard_seen = _NOTHING_SEEN
        if not torch.isfinite(gn):
            # the non-finite guard: this update never reaches the weights; the cause is named in the
            # seed's order (a ratio overflow or extreme log-probs before the gradient itself)
            self.optimizer.zero_grad(set_to_none=True)
            self._advance_schedule()
            self.bad_causes.append(_diagnose(data, ratio_max=ratio_max, logp_min=logp_min, grad_finite=False))
            return float("nan")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)   # gradients are not held through the next rollout
        self.scheduler.step()
        return float(gn)

    # ------------------------------------------------------------------ one step
    def draw_prompts(self, n: int) -> list[int]:
        """Dataset indices for n prompts: the shuffled order, or the curriculum's pick from it."""
        if self.curriculum is None:
            return self.sampler.next(n)
        pool = self.sampler.next(n * self.cfg.data.curriculum.pool_factor)
        return self.curriculum.choose(pool, [self.dataset[i] for i in pool], n, self.step_idx)

    def collect(self) -> tuple[list[int], RolloutBatch, Scored, dict]:
        """Sample and score one batch. With dynamic sampling (DAPO), groups whose rewards are all
        equal are dropped and fresh prompts are sampled, up to `max_sampling_rounds` rounds; if no
        group survives, the last round's batch is used as is (its advantages are all 0)."""
        cfg, G, P = self.cfg, self.cfg.rollout.group_size, self.cfg.prompts_per_step
        rounds = cfg.rollout.max_sampling_rounds if cfg.rollout.dynamic_sampling else 1
        kept_idx: list[int] = []
        kept: list[tuple[RolloutBatch, Scored]] = []
        t_roll = t_rew = 0.0
        for r in range(rounds):
            idx = self.draw_prompts(P)
            rows = [self.dataset[i] for i in idx]
            t = time.perf_counter()
            batch = self.sample(rows)
            t_roll += time.perf_counter() - t
            t = time.perf_counter()
            scored = Scored.of(self.score(rows, batch))
            t_rew += time.perf_counter() - t
            if not cfg.rollout.dynamic_sampling:
                kept_idx, kept = idx, [(batch, scored)]
                break
            flat = zero_variance_groups(scored.total, G)
            take = [g for g, z in enumerate(flat) if not z][:P - len(kept_idx)]
            if take:
                sel = [g * G + k for g in take for k in range(G)]
                kept.append((select_rows(batch, sel), scored.select(sel)))
                kept_idx += [idx[g] for g in take]
            if len(kept_idx) >= P:
                break
        n_varied = len(kept_idx) if cfg.rollout.dynamic_sampling else P
        if not kept:
            kept_idx, kept = idx, [(batch, scored)]
        batch = concat_batches([b for b, _ in kept], self.tokenizer.pad_token_id)
        scored = Scored.concat([s for _, s in kept])
        info = {"time/rollout": t_roll, "time/reward": t_rew, "dynamic/rounds": float(r + 1),
                "dynamic/kept_groups": float(n_varied)}
        return kept_idx, batch, scored, info

    def step(self) -> dict:
        cfg, a, G = self.cfg, self.cfg.algorithm, self.cfg.rollout.group_size
        t_step = time.perf_counter()
        self.bad_causes: list[str] = []      # one per update the guard skips
        try:
            idx, batch, scored, timings = self.collect()
        except NonFiniteLogits as exc:          # nothing to score or update: a bad step
            return self._skip_rollout(str(exc), t_step)
        rows = [self.dataset[i] for i in idx]
        rewards = torch.tensor(scored.total, dtype=torch.float64)
        loss_mask = batch.completion_mask.clone()
        if a.mask_truncated:                                   # DAPO overlong filtering
            loss_mask[[i for i, f in enumerate(batch.finish_reason) if f == "length"]] = 0
        dropped = proxy_filter(self.proxy_rules, completions=batch.completions, lengths=batch.lengths.tolist(),
                               finish_reason=batch.finish_reason, rewards=scored.total, group_size=G,
                               per_fn=scored.per_fn)
        for i, why in enumerate(dropped):
            if why is not None:
                rewards[i], loss_mask[i] = float("nan"), 0
        passed = self.passes(scored)
        if self.curriculum is not None:
            for g, i in enumerate(idx):
                self.curriculum.observe(i, sum(passed[g * G:(g + 1) * G]) / G)

        data = StepData(batch, torch.zeros(len(batch)), loss_mask)
        if a.rewrite.enabled:
            data.rewrites = rewrite_sequences(
                self.tokenizer, batch.prompt_ids, [c[m.bool()].tolist() for c, m in zip(batch.completion_ids, batch.completion_mask)],
                [rows[i // G].get("answer") for i in range(len(batch))],
                [not p for p in passed], template=a.rewrite.template, limit=a.rewrite.max_per_step)
        beta = self.kl_ctl.beta
        t = time.perf_counter()
        all_rows = list(range(len(batch)))
        mbs = self.micro_batches(batch, all_rows) if (self.reference is not None and beta > 0) else []
        if mbs:
            data.ref_logp = self.cached_ref_logprobs(batch, all_rows, mbs)
        kl_in_reward = None
        if a.kl.in_reward and data.ref_logp:                 # KL in the reward: r <- r - beta * sum_t k1
            pol = self.logprobs_of(self.model, mbs)
            data.old_logp = pol
            kl_seq = torch.tensor([float((pol[i] - data.ref_logp[i]).sum()) for i in all_rows], dtype=torch.float64)
            rewards = rewards - beta * kl_seq
            kl_in_reward = float(kl_seq.sum()) / max(1, sum(len(pol[i]) for i in all_rows))   # token mean of k1
        if cfg.rollout.resample_threshold is not None:
            # over-confidence resampling: pi_old is the distribution actually sampled from (q), so
            # the ratio pi_theta / q corrects for the intervention (docs/variants.md)
            data.old_logp = {i: batch.sampler_logprobs[i, :int(batch.completion_mask[i].sum())] for i in all_rows}
        elif (a.mu > 1 or a.mini_batches > 1) and not data.old_logp:
            data.old_logp = self.logprobs_of(self.model, mbs or self.micro_batches(batch, all_rows))
        timings["time/logprobs"] = time.perf_counter() - t

        adv, adv_stats = self.advantages(rewards, batch)
        data.advantages = adv.float()
        data.rewards, data.frac_zero_std = rewards, float(adv_stats.get("frac_zero_std", float("nan")))
        t = time.perf_counter()
        upd = self.update(data, beta)
        timings["time/update"] = time.perf_counter() - t
        drift = self.check_reference(batch)
        self._guard_after_update(skipped=len(self.bad_causes))
        if kl_in_reward is not None:       # no KL term in the loss: kl/ref is the reward's k1
            upd["kl/ref"] = kl_in_reward
        observed_kl = upd.get("kl/ref", 0.0)
        self.kl_ctl.step(observed_kl if math.isfinite(observed_kl) else 0.0)
        timings["time/step"] = time.perf_counter() - t_step

        lengths = batch.lengths.float()
        finite = rewards[torch.isfinite(rewards)]
        m = {
            "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
            "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
            "reward/pass_rate": sum(passed) / len(passed),
            "completion/length_mean": float(lengths.mean()),
            "completion/length_max": float(lengths.max()),
            "completion/clipped_ratio": sum(f == "length" for f in batch.finish_reason) / len(batch),
            "advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()),
            "group/frac_zero_std": float(adv_stats.get("frac_zero_std", float("nan"))),
            "reward/nonfinite": float(adv_stats.get("num_nonfinite", 0)),
            "filter/dropped": float(sum(d is not None for d in dropped)),
            "kl/beta": beta, "optim/lr": self.scheduler.get_last_lr()[0],
            "throughput/tokens_per_s": float(lengths.sum()) / max(timings["time/step"], 1e-9),
            **self._guard_metrics(), "rollout/resampled": float(batch.resampled),
            **scored.metrics, **upd, **timings,
        }
        if self.ref_cache is not None and mbs:
            m.update(self.ref_cache.metrics())
        if drift is not None:
            m["ref/integrity_drift"] = drift
        m["memory/rss_mb"] = rss_mb()
        if self.device.type == "cuda":
            m["memory/cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self._last = (rows, batch, rewards, adv, scored)
        return m

    def passes(self, scored: "Scored") -> list[bool]:
        """Per sample: the first reward function's score reached `algorithm.pass_threshold`."""
        first = scored.per_fn[self.cfg.rewards[0].name]
        return [v is not None and math.isfinite(v) and v >= self.cfg.algorithm.pass_threshold for v in first]

    def updates_per_step(self) -> int:
        """Optimizer steps of one training step: mu passes over `mini_batches` mini-batches."""
        return self.cfg.algorithm.mu * self.cfg.algorithm.mini_batches

    def _guard_after_update(self, skipped: int) -> None:
        """Count what the non-finite guard kept from the weights this step (`skipped` of the step's
        `updates_per_step()` updates) and roll back after `guard.max_consecutive_bad` bad steps in a row.

        A NaN in one mini-batch skips only that mini-batch's update: the others are sound and are
        applied. So the counts are kept apart: `guard/skipped_minibatches` counts every skipped
        update, `guard/skipped_steps` only the steps none of whose updates was applied. A step with
        any skipped update is *bad* all the same: it counts toward the rollback (a NaN tends to come
        back) and the next checkpoint is not marked healthy."""
        if not skipped:
            self.consecutive_bad = 0
            return
        n = self.updates_per_step()
        self.skipped_minibatches += skipped
        if skipped >= n:
            self.skipped_steps += 1
        self.consecutive_bad += 1
        self.bad_since_save = True
        cause = self.bad_causes[0]
        what = "update skipped" if skipped >= n else f"{skipped} of {n} mini-batch updates skipped"
        log.warning("step %d: %s by the non-finite guard: %s", self.step_idx + 1, what, cause)
        self._event({"event": "skip", "step": self.step_idx + 1, "cause": cause,
                     "updates_skipped": skipped, "updates": n})
        if self.consecutive_bad >= self.cfg.guard.max_consecutive_bad:
            self.rollback(cause)

    def _skip_rollout(self, cause: str, t_step: float) -> dict:
        """The step whose rollout met NaN/inf logits: a bad step with no update at all. The
        learning-rate schedule still advances by the step's updates (it counts training steps)."""
        n = self.updates_per_step()
        for _ in range(n):
            self._advance_schedule()
        self.bad_causes = [cause]
        self._guard_after_update(skipped=n)
        self._last = None
        return {"kl/beta": self.kl_ctl.beta, "optim/lr": self.scheduler.get_last_lr()[0], **self._guard_metrics(),
                "time/step": time.perf_counter() - t_step, "memory/rss_mb": rss_mb()}

    def _guard_metrics(self) -> dict[str, float]:
        return {"guard/skipped_steps": float(self.skipped_steps),
                "guard/skipped_minibatches": float(self.skipped_minibatches),
                "guard/rollbacks": float(self.rollbacks)}

    def _event(self, row: dict) -> None:
        import json
        with (self.run_dir / "guard.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def rollback(self, cause: str) -> None:
        """Reload the last healthy checkpoint's weights and optimizer; lower the learning rate.
        The data position and RNG move on, so the same batch is not replayed."""
        g = self.cfg.guard
        ck = ckpt_lib.healthy_checkpoint(self.run_dir)
        if ck is None or self.rollbacks >= g.max_rollbacks:
            why = "no healthy checkpoint to roll back to" if ck is None else f"{self.rollbacks} rollbacks already"
            raise RuntimeError(f"training diverged ({cause}); {why}. Lower optim.lr or check the rewards.")
        ckpt_lib.load_weights(self.model, ck)
        state = ckpt_lib.load_state(ck)
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.scheduler.base_lrs = [lr * g.rollback_lr_factor for lr in self.scheduler.base_lrs]
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        self.rollbacks += 1
        self.consecutive_bad = 0
        self.bad_since_save = False          # the weights are the healthy checkpoint's again
        log.warning("rolled back to %s after %d bad steps (%s); learning rate x%g", ck.name,
                    g.max_consecutive_bad, cause, g.rollback_lr_factor)
        self._event({"event": "rollback", "step": self.step_idx + 1, "to": ck.name, "cause": cause,
                     "lr_factor": g.rollback_lr_factor})

    def advantages(self, rewards: torch.Tensor, batch: RolloutBatch):
        a = self.cfg.algorithm
        kw = {}
        if a.length_buckets is not None:
            kw["buckets"] = a.length_buckets
            kw["bucket_mode"] = a.bucket_mode
        lengths = batch.lengths.to(torch.float64)
        return adv_lib.compute(a.advantage, rewards, self.cfg.rollout.group_size, eps=a.adv_eps,
                               lengths=lengths, return_stats=True, **kw)

    # ------------------------------------------------------------------ the run
    def state_dict(self) -> dict:
        return {
            "step": self.step_idx, "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
            "sampler": self.sampler.state_dict(), "gen": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state(), "py_rng": random.getstate(),
            "skipped_steps": self.skipped_steps, "skipped_minibatches": self.skipped_minibatches,
            "rollbacks": self.rollbacks, "ref_probe": self.ref_probe,
            "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
            "health": self.health.state_dict() if self.health is not None else None,
        }

    def load_state_dict(self, s: dict) -> None:
        self.step_idx = s["step"]
        self.optimizer.load_state_dict(s["optimizer"])
        self.scheduler.load_state_dict(s["scheduler"])
        self.kl_ctl.load_state_dict(s["kl_ctl"])
        self.sampler.load_state_dict(s["sampler"])
        self.gen.set_state(s["gen"])
        torch.set_rng_state(s["torch_rng"])
        np.random.set_state(s["np_rng"])
        random.setstate(s["py_rng"])
        self.skipped_steps = s.get("skipped_steps", 0)
        self.skipped_minibatches = s.get("skipped_minibatches", self.skipped_steps)
        self.rollbacks = s.get("rollbacks", 0)
        self.ref_probe = s.get("ref_probe")
        if self.curriculum is not None and s.get("curriculum"):
            self.curriculum.load_state_dict(s["curriculum"])
        if self.health is not None and s.get("health") is not None:
            self.health.load_state_dict(s["health"])

    def save(self) -> Path:
        """Checkpoint; it counts as healthy when no update was skipped since the previous one."""
        path = ckpt_lib.save_checkpoint(self.run_dir, self.step_idx, self.model, self.tokenizer,
                                        self.state_dict(), keep_last=self.cfg.train.keep_last,
                                        healthy=not self.bad_since_save, merged=self.cfg.lora.save == "merged")
        self.bad_since_save = False
        return path

    def resume(self) -> bool:
        """Restore the latest complete checkpoint of run_dir and drop the rows its logs got after
        that step (the steps will be redone, and logged once); False when there is none."""
        ck = ckpt_lib.latest_checkpoint(self.run_dir)
        if ck is None:
            return False
        ckpt_lib.load_weights(self.model, ck)
        self.load_state_dict(ckpt_lib.load_state(ck))
        self.sink.truncate_after(self.step_idx)
        truncate_jsonl(self.run_dir / "guard.jsonl", self.step_idx)   # alarms.jsonl: the health monitor's own
        self._write_config()
        log.info("resumed from %s (step %d)", ck, self.step_idx)
        return True

    def _write_config(self) -> None:
        """RUN_DIR/config.yaml: the config this run trains with (written once the run directory is
        known to be this run's: after an earlier run was moved aside, or on resume)."""
        atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))

    def start_fresh(self) -> None:
        """Begin a run that does not resume: an earlier run's output in run_dir is moved to
        run_dir/previous/<UTC time>/ (never appended to, never deleted), then the step-0
        checkpoint is saved and, with `train.eval_every: 0`, the baseline evaluation logged as step 0."""
        self.sink.close()                # it may hold RUN_DIR/tb open, which moves too
        moved = ckpt_lib.set_aside_earlier_run(self.run_dir)
        self._write_config()
        self.sink = open_sink(self.run_dir, self.cfg)
        if moved is not None:
            log.warning("%s held the output of an earlier run; moved it to %s", self.run_dir, moved)
        if self.cfg.train.save_every:
            self.save()                  # step 0: a healthy point to roll back to
        if self.cfg.train.eval_every == 0 and self.eval_dataset is not None:
            baseline = self.run_eval()   # held-out accuracy before training
            if baseline:
                self.sink.write(0, baseline)

    def eval_due(self) -> bool:
        """Held-out evaluation after this step: every `train.eval_every` steps and after the last."""
        every = self.cfg.train.eval_every
        return self.eval_dataset is not None and (
            (every > 0 and self.step_idx % every == 0) or self.step_idx == self.cfg.train.steps)

    def run_eval(self) -> dict:
        if self.eval_dataset is None:
            return {}
        gen = torch.Generator(device=self.gen.device)   # its own stream: eval never shifts training's
        gen.manual_seed(self.cfg.train.seed * 1_000_003 + self.step_idx)
        try:
            return evaluate(self.engine, self.encoder, self.rewards, self.eval_dataset, self.cfg,
                            samples=self.cfg.train.eval_samples, generator=gen)
        except NonFiniteLogits as exc:   # the guard's business, not a reason to stop the run
            log.warning("step %d: evaluation skipped: %s", self.step_idx, exc)
            return {}

    def write_samples(self) -> None:
        import json
        if self._last is None:           # the step's rollout was skipped by the guard
            return
        rows, batch, rewards, adv, scored = self._last
        G = self.cfg.rollout.group_size
        d = self.run_dir / "samples"
        d.mkdir(exist_ok=True)
        with (d / f"step_{self.step_idx:06d}.jsonl").open("w") as f:
            for i in range(len(batch)):
                row = rows[i // G]
                f.write(json.dumps({
                    "step": self.step_idx, "prompt": self.encoder.text(row["prompt"]),
                    "completion": batch.completions[i], "answer": row.get("answer"),
                    "reward": float(rewards[i]), "rewards": {k: v[i] for k, v in scored.per_fn.items()},
                    "advantage": float(adv[i]), "length": int(batch.lengths[i]),
                    "finish_reason": batch.finish_reason[i]}) + "\n")

    def train(self, *, resume: bool = False, progress=None) -> dict:
        cfg = self.cfg
        if not (resume and self.resume()):
            self.start_fresh()
        last: dict = {}
        while self.step_idx < cfg.train.steps:
            metrics = self.step()
            self.step_idx += 1
            if self.eval_due():
                metrics.update(self.run_eval())
            self.sink.write(self.step_idx, metrics)
            if self.health is not None:
                self.health.update(self.step_idx, metrics)
            if cfg.train.sample_every and self.step_idx % cfg.train.sample_every == 0:
                self.write_samples()
            if cfg.train.save_every and self.step_idx % cfg.train.save_every == 0:
                self.save()
            if progress is not None:
                progress(self.step_idx, metrics)
            last = metrics
            if self.health is not None and getattr(self.health, "should_stop", False):
                log.warning("stopping: a health alarm configured to stop fired")
                break
        if not cfg.train.save_every or self.step_idx % cfg.train.save_every:
            self.save()
        self.sink.close()
        if self.health is not None:
            log.info("health: %s", self.health.summary())
        return last
