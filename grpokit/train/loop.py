"""The GRPO driver: one `Trainer.step` reads like DeepSeekMath's Algorithm 1 (Shao et al. 2024):

  1. draw B prompts, sample G completions each with the rollout engine;
  2. score every completion with the reward functions (a failing reward scores None -> excluded);
  3. batch transforms (grpokit.train.transforms): overlong masking, proxy filters, curriculum,
     wrong-answer rewriting (dynamic sampling acts while collecting);
  4. reference log-probs once per batch; pi_old only when it differs from the current policy
     (mu > 1, several mini-batches, an engine with its own weights, over-confidence resampling);
  5. group-relative advantages (grpokit.algo.advantages), by group id;
  6. the worker's training step (grpokit.train.worker): mu passes of clipped surrogate + beta * KL;
  7. push the new weights to an engine that holds its own, step the KL controller, log.

With `rollout.async` the engine generates the next batch while step 6 runs (grpokit.train.overlap):
batches are then one step stale, which pi_old and the importance weights of step 4 correct.

The driver only calls: the worker owns the weights, the engine generates, the reference is an
object, transforms change the batch, `RunDir` keeps the run's files, `Guard` counts bad steps.
Departure from the paper: the KL coefficient may change between steps (a controller).
"""

from __future__ import annotations

import logging
import math
import random
import time

import numpy as np
import torch

from grpokit.algo import advantages as adv_lib
from grpokit.algo import kl as kl_lib
from grpokit.algo import loss as loss_lib
from grpokit.config import Config
from grpokit.errors import ConfigError
from grpokit.data.curriculum import Curriculum
from grpokit.data.datasets import PromptSampler
from grpokit.rewards.determinism import check_rows
from grpokit.rollout.base import NonFiniteLogits, PromptStreams, RolloutBatch, SamplingParams
from grpokit.rollout.registry import build_engine
from grpokit.train import batch as batch_lib
from grpokit.train.batch import Batch
from grpokit.train.build import batch_advice, reference_for
from grpokit.train.kl_control import build_kl_controller
from grpokit.train.overlap import OneStepOffPolicy
from grpokit.train.checkpoint import load_state, nothing_to_resume
from grpokit.train.evaluate import held_out
from grpokit.train.guard import Guard
from grpokit.train.prompts import PromptEncoder
from grpokit.train.reference import ReferenceProbe
from grpokit.train.rundir import RunDir, rollback, rss_mb
from grpokit.train.transforms import DynamicSampling, StepContext, build_transforms, passed, rewards_tensor
from grpokit.train.distributed import GatheredEngine
from grpokit.train.worker import LocalWorker

log = logging.getLogger("grpokit.train")


class Trainer:
    """GRPO-family driver over a training worker and a rollout engine. Build it with
    `grpokit.train.build_trainer` (or `grpokit.GRPO`)."""

    def __init__(self, cfg: Config, model, tokenizer, dataset, reward_set, *, eval_dataset=None,
                 reference=None, engine=None, health=None, worker=None):
        """`reference`: a `grpokit.train.reference.Reference`, or None for the config's default
        (`grpokit.train.build.reference_for`). `engine`: a RolloutEngine, or None for
        `rollout.engine`. `worker`: a TrainingWorker, or None for the local one over `model`."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.dataset, self.eval_dataset, self.rewards = dataset, eval_dataset, reward_set
        self.worker = worker or LocalWorker(cfg, model, tokenizer,
                                            reference if reference is not None else reference_for(cfg, model))
        # one rank of a data-parallel job (grpokit.train.distributed): its DistContext, else None
        self.dp = getattr(self.worker, "ctx", None)
        self.run = RunDir(cfg, dist=self.dp)
        self.encoder = PromptEncoder(tokenizer, cfg.data.chat_template)
        self.engine = engine or build_engine(cfg.rollout.engine, self.worker.model, tokenizer, rollout=cfg.rollout)
        if hasattr(self.worker, "gathered"):        # sharded weights: gathered once per rollout
            self.engine = GatheredEngine(self.engine, self.worker)
        dev = next(self.worker.model.parameters()).device
        self.gen = torch.Generator(device="cpu" if dev.type == "cpu" else dev)
        self.gen.manual_seed(cfg.train.seed)
        self.sampler = PromptSampler(len(dataset), seed=cfg.train.seed, shuffle=cfg.data.shuffle)
        self.kl_ctl = build_kl_controller(cfg)
        self.guard = Guard(cfg.guard.max_consecutive_bad)
        self.health = health
        cur = cfg.data.curriculum
        self.curriculum = (Curriculum(start=cur.start, end=cur.end, ramp_steps=cur.ramp_steps, pool_factor=cur.pool_factor,
                                      ema=cur.ema, prior=cur.prior, prior_field=cur.prior_field) if cur.enabled else None)
        self.dynamic = None
        if cfg.rollout.dynamic_sampling:
            on_pass = cfg.rollout.dynamic_sampling_on == "pass"
            self.dynamic = DynamicSampling(cfg.rewards[0].name if on_pass else None, cfg.algorithm.pass_threshold)
        self.transforms = build_transforms(cfg, tokenizer=tokenizer, curriculum=self.curriculum)
        self.overlap = (OneStepOffPolicy(self.engine, lambda: self.draw_prompts(cfg.prompts_per_step),
                                         self.encode_prompts, self.sampling_params(), self.gen)
                        if cfg.rollout.async_ else None)
        self.step_idx = 0
        self.ref_probe = ReferenceProbe(cfg.guard) if self.reference is not None and cfg.guard.ref_check_every else None
        self.last_batch: Batch | None = None          # the last step's batch (sample dumps)
        self.clock = time.monotonic                   # for time-based checkpoints
        self.saved_at = (-1, self.clock())            # (step, clock) of the last checkpoint
        self.best: dict | None = None                 # train.keep_best: {"step", "score"} of RUN_DIR/best
        if cfg.train.keep_best and (eval_dataset is None or self.dp is not None):
            raise ConfigError("train.keep_best needs a validation split (data.eval_path) and one process"
                              if eval_dataset is None else "train.keep_best runs in one process only")

    model = property(lambda self: self.worker.model)
    reference = property(lambda self: self.worker.reference)
    run_dir = property(lambda self: self.run.path)
    device = property(lambda self: next(self.worker.model.parameters()).device)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict:
        """One GRPO step; returns its metrics."""
        cfg, a = self.cfg, self.cfg.algorithm
        t_step = time.perf_counter()
        if self.dp is not None:                     # each rank's own stream, from (seed, step, rank)
            self.gen.manual_seed(self.dp.step_seed(cfg.train.seed, self.step_idx))
        try:
            batch, m = self.collect()                                   # 1-2: generate, score
            failed = None
        except NonFiniteLogits as exc:                                  # nothing to score or update
            failed = str(exc)
        if self.dp is not None and self.dp.any(failed is not None):     # the ranks skip together
            failed = failed or "another rank's rollout met non-finite logits"
        if failed is not None:
            return self._bad_rollout(failed, t_step)
        ctx = StepContext(self.step_idx)
        for transform in self.transforms:                               # 3
            batch = transform(batch, ctx)
        beta = self.kl_ctl.beta
        t = time.perf_counter()
        if self.reference is not None and beta > 0:                     # 4
            batch.ref_logp = self.worker.logprobs(batch, "reference")
        kl_in_reward = None
        if a.kl.in_reward and batch.ref_logp is not None:               # r <- r - beta * sum_t k1
            batch.old_logp = self.worker.logprobs(batch, "policy")
            kl_seq = kl_lib.kl_in_reward(batch.old_logp, batch.ref_logp, batch.mask).to(torch.float64)
            batch.rewards = batch.rewards - beta * kl_seq
            kl_in_reward = {"kl/ref": float(kl_seq.sum()) / max(1, int(batch.mask.sum())),   # token mean of k1
                            "kl/ref_seq": float(kl_seq.mean())}
        m.update(self.old_logprobs(batch))
        m["time/logprobs"] = time.perf_counter() - t
        adv, adv_stats = adv_lib.compute(                               # 5
            a.advantage, batch.rewards, group_ids=batch.group_id, eps=a.adv_eps,
            lengths=batch.lengths.to(torch.float64), return_stats=True,
            **({"buckets": a.length_buckets, "bucket_mode": a.bucket_mode} if a.length_buckets is not None else {}))
        batch.advantages = adv.float()
        batch.frac_zero_std = float(adv_stats.get("frac_zero_std", float("nan")))
        t = time.perf_counter()
        upd = self.worker.train_step(batch, beta, step=self.step_idx)  # 6
        m["time/update"] = time.perf_counter() - t
        drift = self.ref_probe.check(self.worker, batch, self.step_idx) if self.ref_probe is not None else None
        self._after_update(upd.pop("guard/causes"), int(upd.pop("guard/updates_skipped")))
        self.sync_weights()                                             # 7 (after a rollback, too)
        if kl_in_reward is not None:                 # no KL term in the loss: kl/ref is the reward's k1
            upd.update(kl_in_reward)
        observed = upd.get("kl/ref_seq" if a.kl.target_unit == "sequence" else "kl/ref", 0.0)
        self.kl_ctl.step(observed if math.isfinite(observed) else 0.0)
        m["time/step"] = time.perf_counter() - t_step
        self.last_batch = batch
        out = {**self.batch_metrics(batch, adv, adv_stats), "kl/beta": beta, **ctx.metrics, **m, **upd,
               **self.guard.metrics(), **(self.reference.metrics() if self.reference is not None else {}),
               **({"ref/integrity_drift": drift} if drift is not None else {}),
               "throughput/tokens_per_s": float(batch.lengths.sum()) / max(m["time/step"], 1e-9),
               "memory/rss_mb": rss_mb()}
        # the worker's metrics are already the job's; the rest are reduced over ranks
        return out if self.dp is None else self.dp.reduce_metrics(out, agreed=set(upd) | set(self.batch_keys))

    def sampling_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, resample_threshold=r.resample_threshold,
                              ignore_eos=r.ignore_eos)

    def encode_prompts(self, idx: list[int]) -> list[list[int]]:
        return [self.encoder.encode(self.dataset[i]["prompt"]) for i in idx]

    def sample(self, rows: list[dict], streams: PromptStreams | None = None) -> RolloutBatch:
        """Completions of `rows` from the trainer's generator, or one stream per prompt."""
        return self.engine.generate([self.encoder.encode(row["prompt"]) for row in rows], self.sampling_params(),
                                    self.gen if streams is None else streams)

    def score(self, batch: Batch) -> Batch:
        """Fill the batch's rewards: weighted totals (NaN = could not be scored) and each function's."""
        keys = sorted({k for row in batch.rows for k in row if k != "prompt"})
        columns = {k: [row.get(k) for row in batch.rows] for k in keys}
        columns.update(completion_length=batch.lengths.tolist(), finish_reason=list(batch.finish_reason),
                       group_id=batch.group_id.tolist(), max_new_tokens=[self.cfg.rollout.max_new_tokens] * len(batch))
        out = self.rewards.score([self.encoder.text(row["prompt"]) for row in batch.rows], batch.completions, columns)
        batch.rewards = rewards_tensor(out.total)
        batch.scores = {k: list(v) for k, v in out.per_fn.items()}
        batch.reward_metrics = {k: float(v) for k, v in out.metrics.items()}
        return batch

    def draw_prompts(self, n: int) -> list[int]:
        """Dataset indices for n prompts: the shuffled order, or the curriculum's pick from it."""
        if self.curriculum is None:
            return self.sampler.next(n)
        pool = self.sampler.next(n * self.cfg.data.curriculum.pool_factor)
        return self.curriculum.choose(pool, [self.dataset[i] for i in pool], n, self.step_idx)

    def collect(self) -> tuple[Batch, dict]:
        """Sample and score one batch of `prompts_per_step` groups. With dynamic sampling, groups
        whose rewards are all equal are dropped and fresh prompts sampled, up to
        `max_sampling_rounds` rounds; if none survives, the last round's batch is used as is."""
        cfg, G, P = self.cfg, self.cfg.rollout.group_size, self.cfg.prompts_per_step
        rounds = cfg.rollout.max_sampling_rounds if self.dynamic is not None else 1
        kept: list[Batch] = []
        n_kept, t_roll, t_rew = 0, 0.0, 0.0
        self._engine_memory("resume_memory")          # a colocated engine gets its memory back
        for r in range(rounds):
            t = time.perf_counter()
            if self.overlap is not None and r == 0:   # generated while the last step trained
                idx, rb = self.overlap.take()
                rows = [self.dataset[i] for i in idx]
            else:
                idx = self.draw_prompts(P)
                streams = None
                if self.dp is not None:               # this rank's whole groups of the global draw,
                    idx = self.dp.my_prompts(idx)     # each sampled from its own seeded stream
                    streams = PromptStreams(self.dp.group_seeds(cfg.train.seed, self.step_idx, r * P, P))
                rows = [self.dataset[i] for i in idx]
                rb = self.sample(rows, streams)
            t_roll += time.perf_counter() - t
            if r == 0:
                staleness = self._staleness(rb)
            t = time.perf_counter()
            first = r * P if self.dp is None else self.dp.first_group(r, P)
            fresh = self.score(batch_lib.from_rollout(rb, idx, rows, G, step=self.step_idx, first_group=first))
            t_rew += time.perf_counter() - t
            if self.dynamic is None:
                kept = [fresh]
                break
            if self.dp is None:
                good = self.dynamic(fresh, StepContext(self.step_idx), want=P - n_kept)
                n_new = len(good.groups)
            else:                                     # the quota is global: ranks agree on the count
                good = self.dynamic(fresh, StepContext(self.step_idx))
                mine, n_new = self.dp.keep_groups(len(good.groups), P - n_kept)
                good = batch_lib.slice_groups(good, good.groups[:mine])
            if len(good):
                kept.append(good)
            n_kept += n_new
            if n_kept >= P:
                break
        if self.overlap is not None and self.step_idx + 1 < cfg.train.steps:
            self.overlap.submit()                     # batch k+1 from weights k, while step k trains
        else:
            self._engine_memory("release_memory")     # ... and gives it to the update
        metrics = {"time/rollout": t_roll, "time/reward": t_rew, "dynamic/rounds": float(r + 1),
                   "dynamic/kept_groups": float(n_kept if self.dynamic is not None else P), **staleness}
        batch = batch_lib.concat(kept or [fresh], self.tokenizer.pad_token_id)
        metrics.update(batch_lib.merged_reward_metrics(kept or [fresh]))
        return batch, metrics

    def _staleness(self, rb: RolloutBatch) -> dict[str, float]:
        """`rollout/staleness`: optimizer steps between the weights that sampled `rb` and the ones
        about to train on it (engines that report a weights version). Weights that have trained k
        steps are version k, so it is `step_idx - version`: 0 on-policy, at most 1 with
        `rollout.async`; anything else means the engine sampled from weights it should not have."""
        if rb.weights_version is None:
            return {}
        staleness, allowed = self.step_idx - rb.weights_version, int(self.overlap is not None)
        if not 0 <= staleness <= allowed:
            raise RuntimeError(f"step {self.step_idx + 1}: the rollout engine sampled with weights version "
                               f"{rb.weights_version}, {staleness} steps behind the trainer's (allowed: {allowed})")
        return {"rollout/staleness": float(staleness)}

    def _engine_memory(self, what: str) -> None:
        """Call the engine's optional `release_memory` / `resume_memory` when it has one."""
        fn = getattr(self.engine, what, None)
        if fn is not None:
            fn()

    def old_logprobs(self, batch: Batch) -> dict[str, float]:
        """pi_old for the ratio. Over-confidence resampling: the distribution actually sampled from
        (q), so the ratio pi_theta / q corrects for the intervention (docs/variants.md). An engine
        with its own weights: the trainer's log-probs, with truncated importance weights for the
        sampler/trainer mismatch (docs/algorithms.md). mu > 1 or several mini-batches: the policy
        before the update. Otherwise None: the current log-probs, detached, are pi_old exactly."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        if r.resample_threshold is not None:
            batch.old_logp = batch.sampler_logp.clone()
            return {}
        if getattr(self.engine, "owns_weights", False):
            if batch.old_logp is None:
                batch.old_logp = self.worker.logprobs(batch, "policy")
            w, st = loss_lib.truncated_is_weights(batch.old_logp.float(), batch.sampler_logp.float(),
                                                 batch.mask, cap=r.is_cap)
            if r.is_correction:
                batch.is_weights = w
            return {f"rollout/{k}": v for k, v in st.items()}
        if (a.mu > 1 or a.mini_batches > 1) and batch.old_logp is None:
            batch.old_logp = self.worker.logprobs(batch, "policy")
        return {}

    def sync_weights(self, version: int | None = None) -> None:
        """Push the trained weights to an engine that holds its own copy (no-op otherwise). Their
        version is the number of steps they have trained: `step_idx + 1` inside a step."""
        if getattr(self.engine, "owns_weights", False):
            self.engine.update_weights(self.worker.export_weights(),
                                       version=self.step_idx + 1 if version is None else version)

    batch_keys = ("reward/mean", "reward/std", "reward/pass_rate", "completion/length_mean", "completion/length_max",
                  "completion/clipped_ratio", "advantage/mean", "advantage/std", "group/frac_zero_std",
                  "reward/nonfinite", "rollout/resampled")

    def batch_metrics(self, batch: Batch, adv: torch.Tensor, adv_stats: dict) -> dict[str, float]:
        """Statistics of the step's batch; in a data-parallel job of the whole batch over ranks (the
        ranks' rewards, lengths and advantages gathered: a few numbers per completion)."""
        ok = passed(batch, self.cfg.rewards[0].name, self.cfg.algorithm.pass_threshold)
        n_groups = len(torch.unique(batch.group_id))
        part = {"lengths": batch.lengths.float().tolist(), "rewards": batch.rewards.tolist(), "ok": [bool(x) for x in ok],
                "length_stop": [f == "length" for f in batch.finish_reason], "adv": adv.tolist(),
                "zero_groups": float(adv_stats.get("frac_zero_std", float("nan"))) * n_groups, "groups": n_groups,
                "nonfinite": float(adv_stats.get("num_nonfinite", 0)), "resampled": float(batch.resampled)}
        parts = [part] if self.dp is None else self.dp.gather(part)
        cat = {k: sum((p[k] for p in parts), []) for k in ("lengths", "rewards", "ok", "length_stop", "adv")}
        lengths = torch.tensor(cat["lengths"])
        rewards = torch.tensor(cat["rewards"], dtype=batch.rewards.dtype)
        advs = torch.tensor(cat["adv"], dtype=adv.dtype)
        finite = rewards[torch.isfinite(rewards)]
        groups = sum(p["groups"] for p in parts)
        return {
            "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
            "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
            "reward/pass_rate": sum(cat["ok"]) / len(cat["ok"]),
            "completion/length_mean": float(lengths.mean()), "completion/length_max": float(lengths.max()),
            "completion/clipped_ratio": sum(cat["length_stop"]) / len(cat["length_stop"]),
            "advantage/mean": float(advs.mean()), "advantage/std": float(advs.std()),
            "group/frac_zero_std": sum(p["zero_groups"] for p in parts) / max(groups, 1),
            "reward/nonfinite": sum(p["nonfinite"] for p in parts),
            "rollout/resampled": sum(p["resampled"] for p in parts),
        }

    # ------------------------------------------------------------------ guard
    def _after_update(self, causes: list[str], skipped: int) -> None:
        """Count what the guard kept from the weights; roll back after `guard.max_consecutive_bad`
        bad steps in a row."""
        n = self.worker.updates_per_step()
        due = self.guard.after_step(skipped, n)
        if not skipped:
            return
        cause = causes[0]
        what = "update skipped" if skipped >= n else f"{skipped} of {n} mini-batch updates skipped"
        log.warning("step %d: %s by the non-finite guard: %s", self.step_idx + 1, what, cause)
        self.run.event({"event": "skip", "step": self.step_idx + 1, "cause": cause, "updates_skipped": skipped, "updates": n})
        if due:
            rollback(self.run, self.worker, self.kl_ctl, self.guard, cause, self.step_idx + 1)

    def _bad_rollout(self, cause: str, t_step: float) -> dict:
        """The step whose rollout met NaN/inf logits: a bad step with no update at all. The
        learning-rate schedule still advances by the step's updates (it counts training steps)."""
        self.worker.skip_step()
        self._after_update([cause], self.worker.updates_per_step())
        self.sync_weights()                          # the weights may have been rolled back
        self.last_batch = None
        return {"kl/beta": self.kl_ctl.beta, "optim/lr": self.worker.scheduler.get_last_lr()[0],
                **self.guard.metrics(), "time/step": time.perf_counter() - t_step, "memory/rss_mb": rss_mb()}

    # ------------------------------------------------------------------ the run
    def state_dict(self) -> dict:
        return {
            "step": self.step_idx, **self.worker.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
            "sampler": self.sampler.state_dict(), "gen": self.gen.get_state(),
            "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state(), "py_rng": random.getstate(),
            **self.guard.state_dict(),
            "ref_probe": self.ref_probe.state_dict() if self.ref_probe is not None else None,
            "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
            "health": self.health.state_dict() if self.health is not None else None,
            "rollout_in_flight": self.overlap.state_dict() if self.overlap is not None else None,
        }

    def load_state_dict(self, s: dict) -> None:
        self.step_idx = s["step"]
        self.worker.load_state_dict(s)
        self.kl_ctl.load_state_dict(s["kl_ctl"])
        self.sampler.load_state_dict(s["sampler"])
        self.gen.set_state(s["gen"])
        torch.set_rng_state(s["torch_rng"])
        np.random.set_state(s["np_rng"])
        random.setstate(s["py_rng"])
        self.guard.load_state_dict(s)
        if self.ref_probe is not None:
            self.ref_probe.load_state_dict(s.get("ref_probe"))
        if self.curriculum is not None and s.get("curriculum"):
            self.curriculum.load_state_dict(s["curriculum"])
        if self.health is not None and s.get("health") is not None:
            self.health.load_state_dict(s["health"])
        if self.overlap is not None:
            self.overlap.load_state_dict(s.get("rollout_in_flight"))

    def save(self):
        """Checkpoint; it counts as healthy when no update was skipped since the previous one."""
        path = self.run.save(self.step_idx, self.worker, self.tokenizer, self.state_dict(),
                             healthy=not self.guard.bad_since_save)
        self.guard.bad_since_save = False
        self.saved_at = (self.step_idx, self.clock())
        return path

    def save_due(self) -> bool:
        """A checkpoint after this step: every `train.save_every` steps, or `train.save_every_minutes`
        after the last one, whichever comes first."""
        t = self.cfg.train
        return bool((t.save_every and self.step_idx % t.save_every == 0) or
                    (t.save_every_minutes and self.clock() - self.saved_at[1] >= 60 * t.save_every_minutes))

    def resume(self) -> bool:
        """Restore the latest complete checkpoint of run_dir; False when there is none."""
        ck = self.run.latest()
        if ck is None:
            return False
        self.worker.load_weights(ck)
        self.load_state_dict(load_state(ck))
        self.sync_weights(version=self.step_idx)     # a restarted engine gets the checkpoint's weights
        self.saved_at = (self.step_idx, self.clock())
        self.run.resumed(self.step_idx)
        if self.cfg.train.keep_best:                 # RUN_DIR/best holds the best policy evaluated so far
            self.best = self.run.read_best()
        log.info("resumed from %s (step %d)", ck, self.step_idx)
        return True

    def start_fresh(self) -> None:
        """A run that does not resume: earlier output moved aside, the step-0 checkpoint saved and,
        with `train.eval_every: 0`, the baseline evaluation logged as step 0."""
        self.run.start_fresh()
        advice = batch_advice(self.cfg)
        if advice:
            log.warning(advice)
        if self.cfg.train.check_rewards:             # rewards must be deterministic
            for line in check_rows(self.rewards, self.dataset, prompt_text=self.encoder.text,
                                   max_new_tokens=self.cfg.rollout.max_new_tokens):
                log.warning(line)
        if self.cfg.train.save_every or self.cfg.train.save_every_minutes:
            self.save()                  # step 0: a healthy point to roll back to
        if (self.cfg.train.eval_every == 0 or self.cfg.train.keep_best) and self.eval_dataset is not None:
            baseline = self.run_eval()   # held-out accuracy before training
            if baseline:
                self.run.sink.write(0, baseline)

    def eval_due(self) -> bool:
        """Held-out evaluation after this step: every `train.eval_every` steps and after the last."""
        every = self.cfg.train.eval_every
        return self.eval_dataset is not None and (
            (every > 0 and self.step_idx % every == 0) or self.step_idx == self.cfg.train.steps)

    def run_eval(self) -> dict:
        if self.eval_dataset is None:
            return {}
        out = held_out(self.engine, self.encoder, self.rewards, self.eval_dataset, self.cfg,
                       seed=self.cfg.train.seed * 1_000_003 + self.step_idx, step=self.step_idx,
                       device=self.gen.device)
        if self.cfg.train.keep_best:
            self.consider_best(out.get("eval/pass@1"))
        return out

    def consider_best(self, score: float | None) -> None:
        """`train.keep_best`: the policy now is the best so far when its validation score is at least
        the best one's (a tie goes to the later, more trained policy); then it is written to
        RUN_DIR/best/. A failed evaluation (None, NaN) is never the best."""
        if score is None or not math.isfinite(score):
            return
        if self.best is None or score >= self.best["score"]:
            self.run.save_best(self.step_idx, self.worker, self.tokenizer, score)
            self.best = {"step": self.step_idx, "score": score}

    def restore_best(self) -> None:
        """`train.keep_best`, at the end of a run: the policy becomes RUN_DIR/best/'s (the checkpoints
        keep the last one) and the rollout engine gets its weights."""
        if self.best is None or self.best["step"] == self.step_idx:
            if self.best is not None:
                log.info("keep_best: the last policy (step %d) is the best (eval/pass@1 %.3f)",
                         self.step_idx, self.best["score"])
            return
        self.worker.load_weights(self.run.path / "best")
        self.sync_weights(version=self.best["step"])
        log.info("keep_best: ending with step %d's policy (eval/pass@1 %.3f; RUN_DIR/best), not step %d's",
                 self.best["step"], self.best["score"], self.step_idx)

    def write_samples(self) -> None:
        if self.last_batch is not None:  # None: the step's rollout was skipped by the guard
            self.run.write_samples(self.step_idx, self.last_batch, self.encoder.text)

    def train(self, *, resume: bool = False, progress=None) -> dict:
        cfg = self.cfg
        if resume and self.run.latest() is None:
            problem = nothing_to_resume(self.run.path, flag="resume=True")
            if problem is not None:
                raise ConfigError(problem)
            log.warning("resume: %s holds no complete checkpoint; starting over from step 0", self.run.path)
        if not (resume and self.resume()):
            self.start_fresh()
        last: dict = {}
        started = self.clock() if cfg.train.max_minutes else 0.0
        while self.step_idx < cfg.train.steps:
            metrics = self.step()
            self.step_idx += 1
            out_of_time = bool(cfg.train.max_minutes) and self.clock() - started >= 60 * cfg.train.max_minutes
            if self.dp is not None:                   # clocks differ: every rank stops after the same step
                out_of_time = self.dp.any(out_of_time)
            if self.eval_due() or (out_of_time and cfg.train.keep_best):   # keep_best: the last policy too
                metrics.update(self.run_eval())
            self.run.sink.write(self.step_idx, metrics)
            if self.health is not None:
                self.health.update(self.step_idx, metrics)
            if cfg.train.sample_every and self.step_idx % cfg.train.sample_every == 0:
                self.write_samples()
            if self.save_due():
                self.save()
            if progress is not None:
                progress(self.step_idx, metrics)
            last = metrics
            stop = self.health is not None and getattr(self.health, "should_stop", False)
            if self.dp is not None:                   # rank 0 monitors: every rank stops together
                stop = self.dp.any(stop)
            if stop:
                log.warning("stopping: a health alarm configured to stop fired")
                break
            if out_of_time:
                log.info("stopping after step %d: train.max_minutes=%g reached", self.step_idx, cfg.train.max_minutes)
                break
        if self.saved_at[0] != self.step_idx:
            self.save()
        if cfg.train.keep_best:
            self.restore_best()
        self.run.close()
        if self.health is not None:
            log.info("health: %s", self.health.summary())
        return last

