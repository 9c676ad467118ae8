"""One GRPO step, as DeepSeekMath's Algorithm 1 (Shao et al. 2024) writes it:

  1. draw B prompts, sample G completions each with the rollout engine;      (the collector)
  2. score every completion with the reward functions (a failing reward scores None -> excluded);
  3. batch transforms (grpokit.train.transforms): overlong masking, proxy filters, curriculum,
     wrong-answer rewriting (dynamic sampling acts while collecting);
  4. reference log-probs once per batch; pi_old only when it differs from the current policy
     (mu > 1, several mini-batches, an engine with its own weights, over-confidence resampling);
  5. group-relative advantages (grpokit.algo.advantages), by group id;
  6. the worker's training step (grpokit.train.worker): mu passes of clipped surrogate + beta * KL;
  7. push the new weights to an engine that holds its own, step the KL controller, log.

`Step` takes built objects and reads no config (`StepSettings` is what it needs of the config,
filled in by the builder). It calls, never owns: the worker owns the weights, the collector the
rollout, `RunDir` the files, `Guard` the count of bad steps, the `Comm` the other ranks.
Departure from the paper: the KL coefficient may change between steps (a controller).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from grpokit.algo import advantages as adv_lib
from grpokit.algo import kl as kl_lib
from grpokit.algo import loss as loss_lib
from grpokit.rollout.base import NonFiniteLogits
from grpokit.train import batch as batch_lib
from grpokit.train.batch import Batch
from grpokit.train.collect import owns_weights
from grpokit.train.rundir import rollback, rss_mb
from grpokit.train.transforms import StepContext, passed

log = logging.getLogger("grpokit.train")


@dataclass(frozen=True)
class StepSettings:
    """What one step needs of the config (grpokit.train.builder fills it in)."""

    advantage: str = "grpo"
    adv_eps: float = 1e-6
    length_buckets: tuple | None = None
    bucket_mode: str | None = None
    kl_in_reward: bool = False
    kl_unit: str = "token"               # the unit the KL controller is fed: "token" or "sequence"
    resampling: bool = False             # over-confidence resampling: pi_old is the sampler's q
    is_cap: float = 2.0
    is_correction: bool = True
    old_logp_needed: bool = False        # mu > 1 or several mini-batches
    pass_reward: str = ""
    pass_threshold: float = 1.0
    kl_estimator: str = "k3"
    kl_measure_every: int = 0            # beta = 0: KL to the reference measured every N steps (0 = never)
    kl_measure_rows: int = 16


def sync_weights(engine, worker, version: int, comm=None) -> dict[str, float]:
    """Push the trained weights to an engine that holds its own copy (no-op otherwise). Their
    version is the number of optimizer steps they have trained. A LoRA policy sends its adapters
    alone to an engine that folds them in (`takes_adapters`: a rollout server's HF backend), with the
    base weights first where the engine lacks them; anything else goes as full (merged) weights.
    Every rank of a data-parallel job calls it (the exports are collective under FSDP2; `comm`
    makes the ranks agree on sending the base). Returns what the engine reports of the push
    (`time/sync`, `sync/mb`, `sync/parts` for a rollout server), else {}."""
    if not owns_weights(engine):
        return {}
    export = getattr(worker, "export_adapters", None)
    adapters = export() if export is not None and getattr(engine, "takes_adapters", False) else None
    if adapters is not None:
        need = engine.needs_base()
        if comm is not None:
            need = comm.any(need)
        engine.update_adapters(*adapters, base=worker.export_base() if need else None, version=version)
    else:
        engine.update_weights(worker.export_weights(), version=version)
    return dict(getattr(engine, "last_sync", None) or {})


BATCH_KEYS = ("reward/mean", "reward/std", "reward/pass_rate", "completion/length_mean", "completion/length_max",
              "completion/clipped_ratio", "advantage/mean", "advantage/std", "group/frac_zero_std",
              "reward/nonfinite", "rollout/resampled")


class Step:
    """Batch -> transforms -> log-probs -> advantages -> `train_step` -> sync -> guard -> controller
    -> metrics, for step `step_idx` (0-based)."""

    def __init__(self, *, settings: StepSettings, collector, worker, transforms, kl_ctl, guard, comm, run,
                 ref_probe=None, seed: int = 0, entropy_ctl=None):
        self.s, self.collector, self.worker, self.transforms = settings, collector, worker, transforms
        self.kl_ctl, self.guard, self.comm, self.run, self.ref_probe = kl_ctl, guard, comm, run, ref_probe
        self.seed = seed
        self.entropy_ctl = entropy_ctl                # grpokit.algo.entropy.EntropyControl, or None
        self.last_batch: Batch | None = None          # the last step's batch (sample dumps)

    engine = property(lambda self: self.collector.engine)
    reference = property(lambda self: self.worker.reference)

    def __call__(self, step_idx: int) -> dict:
        s, comm = self.s, self.comm
        t_step = time.perf_counter()
        comm.seed_step(self.collector.gen, self.seed, step_idx)     # a job's ranks: streams per step
        try:
            batch, m = self.collector.collect(step_idx)               # 1-2: generate, score
            failed = None
        except NonFiniteLogits as exc:                                  # nothing to score or update
            failed = str(exc)
        if comm.any(failed is not None):                                # the ranks skip together
            return self._bad_rollout(failed or "another rank's rollout met non-finite logits", step_idx, t_step)
        ctx = StepContext(step_idx)
        for transform in self.transforms:                               # 3
            batch = transform(batch, ctx)
        batch = self.collector.segments(batch)          # step-wise episodes: one row per turn from here
        reps, expand = batch_lib.episodes_of(batch)
        beta = self.kl_ctl.beta
        t = time.perf_counter()
        if self.reference is not None and beta > 0:                     # 4
            batch.ref_logp = self.worker.logprobs(batch, "reference")
        kl_in_reward = None
        if s.kl_in_reward and batch.ref_logp is not None:               # r <- r - beta * sum_t k1
            batch.old_logp = self.worker.logprobs(batch, "policy")
            kl_rows = kl_lib.kl_in_reward(batch.old_logp, batch.ref_logp, batch.action_mask).to(torch.float64)
            kl_seq = torch.zeros(len(reps), dtype=torch.float64).index_add_(0, expand, kl_rows)   # per episode
            batch.rewards = batch.rewards - beta * kl_seq[expand]
            kl_in_reward = {"kl/ref": float(kl_seq.sum()) / max(1, int(batch.action_mask.sum())),   # token mean of k1
                            "kl/ref_seq": float(kl_seq.mean())}
        measured = None
        if beta == 0 and self.reference is not None and s.kl_measure_every and step_idx % s.kl_measure_every == 0:
            measured = self.measure_kl(batch)                           # no KL term, the signal kept
        m.update(self.old_logprobs(batch))
        m["time/logprobs"] = time.perf_counter() - t
        lengths = torch.zeros(len(reps), dtype=torch.float64).index_add_(0, expand, batch.lengths.to(torch.float64))
        adv, adv_stats = adv_lib.compute(                               # 5: one advantage per episode
            s.advantage, batch.rewards[reps], group_ids=batch.group_id[reps], eps=s.adv_eps,
            lengths=lengths, return_stats=True,
            **({"buckets": s.length_buckets, "bucket_mode": s.bucket_mode} if s.length_buckets is not None else {}))
        batch.advantages = adv.float()[expand]
        batch.frac_zero_std = float(adv_stats.get("frac_zero_std", float("nan")))
        t = time.perf_counter()
        upd = self.worker.train_step(batch, beta, step=step_idx)      # 6
        m["time/update"] = time.perf_counter() - t
        drift = self.ref_probe.check(self.worker, batch, step_idx) if self.ref_probe is not None else None
        self._after_update(upd.pop("guard/causes"), int(upd.pop("guard/updates_skipped")), step_idx)
        m.update(self.collector.settle())              # episodes in flight finish on the weights they began with
        m.update(sync_weights(self.engine, self.worker, step_idx + 1, self.comm) or {})  # 7 (after a rollback, too)
        if kl_in_reward is not None:                 # no KL term in the loss: kl/ref is the reward's k1
            upd.update(kl_in_reward)
        if self.entropy_ctl is not None:              # the next update's bonus (grpokit.algo.entropy)
            self.worker.entropy_coef = self.entropy_ctl.update(upd.get("policy/entropy", float("nan")))
            upd["policy/entropy_coef"] = self.worker.entropy_coef
        observed = upd.get("kl/ref_seq" if s.kl_unit == "sequence" else "kl/ref", 0.0)
        self.kl_ctl.step(observed if math.isfinite(observed) else 0.0)
        if getattr(self.kl_ctl, "handed_over", False):
            log.info("step %d: the KL warm-up ends (beta %.4g held for %d steps); the %s controller takes over "
                     "from beta %.4g", step_idx + 1, beta, self.kl_ctl.steps, self.kl_ctl.inner.kind, self.kl_ctl.beta)
        m["time/step"] = time.perf_counter() - t_step
        self.last_batch = batch
        out = {**self.batch_metrics(batch, adv, adv_stats, reps, lengths), "kl/beta": beta, **ctx.metrics, **m, **upd,
               **(measured or {}),                   # this rank's sample: reduced over ranks below
               **self.guard.metrics(), **(self.reference.metrics() if self.reference is not None else {}),
               **({"ref/integrity_drift": drift} if drift is not None else {}),
               "throughput/tokens_per_s": float(batch.lengths.sum()) / max(m["time/step"], 1e-9),
               "memory/rss_mb": rss_mb()}
        # the worker's metrics are already the job's; the rest are reduced over ranks
        return comm.reduce_metrics(out, agreed=set(upd) | set(BATCH_KEYS) | {k for k in out if k.startswith("agent/")})

    @torch.no_grad()
    def measure_kl(self, batch: Batch) -> dict[str, float]:
        """KL(pi_theta || pi_ref) with beta = 0, on the step's first `kl_measure_rows` completions
        before the update: the configured estimator per token, as the loss would compute it, as
        `kl/ref` (token mean) and `kl/ref_seq` (per completion); two forward passes, no backward."""
        s = self.s
        rows = [i for i in range(len(batch)) if batch.action_mask[i].any()][:s.kl_measure_rows]
        # every rank calls both passes, with or without rows (a sharded policy's forward is collective)
        ref = self.worker.logprobs(batch, "reference", rows=rows, dropout=False)[rows].float()
        pol = self.worker.logprobs(batch, "policy", rows=rows)[rows].float()
        if not rows:
            return {}
        mask = batch.action_mask[rows].float()
        on = mask.bool()
        if not (torch.isfinite(pol[on]).all() and torch.isfinite(ref[on]).all()):
            log.warning("KL measurement skipped this step: non-finite log-probs (the update's guard looks at them)")
            return {}
        per_tok = kl_lib.estimate(pol, ref, s.kl_estimator) * mask
        return {"kl/ref": float(per_tok.sum()) / max(float(mask.sum()), 1.0),
                "kl/ref_seq": float(per_tok.sum(-1).mean()), "kl/measured_rows": float(len(rows))}

    def old_logprobs(self, batch: Batch) -> dict[str, float]:
        """pi_old for the ratio. Over-confidence resampling: the distribution actually sampled from
        (q), so the ratio pi_theta / q corrects for the intervention (docs/variants.md). An engine
        with its own weights: the trainer's log-probs, with truncated importance weights for the
        sampler/trainer mismatch (docs/algorithms.md). mu > 1 or several mini-batches: the policy
        before the update. Otherwise None: the current log-probs, detached, are pi_old exactly."""
        s = self.s
        if s.resampling:
            batch.old_logp = batch.sampler_logp.clone()
            return {}
        if owns_weights(self.engine):
            if batch.old_logp is None:
                batch.old_logp = self.worker.logprobs(batch, "policy")
            w, st = loss_lib.truncated_is_weights(batch.old_logp.float(), batch.sampler_logp.float(),
                                                 batch.action_mask, cap=s.is_cap)
            if s.is_correction:
                batch.is_weights = w
            return {f"rollout/{k}": v for k, v in st.items()}
        if s.old_logp_needed and batch.old_logp is None:
            batch.old_logp = self.worker.logprobs(batch, "policy")
        return {}

    def batch_metrics(self, batch: Batch, adv: torch.Tensor, adv_stats: dict, reps: list[int],
                      lengths: torch.Tensor) -> dict[str, float]:
        """Statistics of the step's batch, one value per completion or episode (`reps`, `lengths`,
        `adv`: per episode); in a data-parallel job of the whole batch over ranks (the ranks'
        rewards, lengths and advantages gathered: a few numbers per completion)."""
        ok = passed(batch, self.s.pass_reward, self.s.pass_threshold)
        n_groups = len(torch.unique(batch.group_id))
        part = {"lengths": lengths.float().tolist(), "rewards": batch.rewards[reps].tolist(),
                "ok": [bool(ok[i]) for i in reps],
                "length_stop": [batch.finish_reason[i] == "length" for i in reps], "adv": adv.tolist(),
                "zero_groups": float(adv_stats.get("frac_zero_std", float("nan"))) * n_groups, "groups": n_groups,
                "nonfinite": float(adv_stats.get("num_nonfinite", 0)), "resampled": float(batch.resampled)}
        parts = self.comm.gather(part)
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
    def _after_update(self, causes: list[str], skipped: int, step_idx: int) -> None:
        """Count what the guard kept from the weights; roll back after `guard.max_consecutive_bad`
        bad steps in a row."""
        n = self.worker.updates_per_step()
        due = self.guard.after_step(skipped, n)
        if not skipped:
            return
        cause = causes[0]
        what = "update skipped" if skipped >= n else f"{skipped} of {n} mini-batch updates skipped"
        log.warning("step %d: %s by the non-finite guard: %s", step_idx + 1, what, cause)
        self.run.event({"event": "skip", "step": step_idx + 1, "cause": cause, "updates_skipped": skipped, "updates": n})
        if due:
            rollback(self.run, self.worker, self.kl_ctl, self.guard, cause, step_idx + 1, self.entropy_ctl)

    def _bad_rollout(self, cause: str, step_idx: int, t_step: float) -> dict:
        """The step whose rollout met NaN/inf logits: a bad step with no update at all. The
        learning-rate schedule still advances by the step's updates (it counts training steps)."""
        self.worker.skip_step()
        self._after_update([cause], self.worker.updates_per_step(), step_idx)
        self.collector.settle()
        sync_weights(self.engine, self.worker, step_idx + 1, self.comm)  # the weights may have been rolled back
        self.last_batch = None
        return {"kl/beta": self.kl_ctl.beta, "optim/lr": self.worker.scheduler.get_last_lr()[0],
                **self.guard.metrics(), "time/step": time.perf_counter() - t_step, "memory/rss_mb": rss_mb()}
