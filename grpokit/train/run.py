"""The run's clock: resume or a fresh start, the step loop, the cadence of checkpoints, held-out
evaluation and sample dumps, `train.keep_best`, the time budget, early stop on a health alarm, and
what a run leaves when it ends (the last checkpoint, the report, the process group closed).

`Trainer` is built by `grpokit.train.builder.build_run` (the only place config becomes objects);
one step is `grpokit.train.step.Step`, one rollout round `grpokit.train.collect.Collector`. The
run never asks which rank it is: the `Comm` answers (a single process is rank 0 of 1).
"""

from __future__ import annotations

import logging
import math
import random
import time

import numpy as np
import torch

from grpokit.errors import ConfigError
from grpokit.train.checkpoint import load_state, nothing_to_resume
from grpokit.train.evaluate import build_checker, held_out
from grpokit.train.step import sync_weights

log = logging.getLogger("grpokit.train")


class Trainer:
    """A GRPO-family run over built parts: `step` (one update), its `collector`, the training
    `worker`, the run directory `run`, the `comm`, and optionally a held-out set and a health monitor."""

    def __init__(self, cfg, *, step, worker, run, comm, tokenizer, dataset, rewards, encoder,
                 eval_dataset=None, checker=None, health=None, on_exit=None, fresh_notes=None):
        self.cfg, self.step_fn, self.worker, self.run, self.comm = cfg, step, worker, run, comm
        self.tokenizer, self.dataset, self.rewards, self.encoder = tokenizer, dataset, rewards, encoder
        self.eval_dataset, self.health = eval_dataset, health
        self.checker = checker                       # the RewardSet scoring held-out pass@1 (eval.checker)
        self.on_exit = on_exit or []                 # callables run once when `train` ends (the report)
        self.fresh_notes = fresh_notes or (lambda: [])   # the set-up warnings of a fresh start
        self.step_idx = 0
        self.clock = time.monotonic                   # for time-based checkpoints and the budget
        self.saved_at = (-1, self.clock())            # (step, clock) of the last checkpoint
        self.best: dict | None = None                 # train.keep_best: {"step", "score"} of RUN_DIR/best

    collector = property(lambda self: self.step_fn.collector)
    engine = property(lambda self: self.step_fn.collector.engine)
    model = property(lambda self: self.worker.model)
    reference = property(lambda self: self.worker.reference)
    run_dir = property(lambda self: self.run.path)
    device = property(lambda self: next(self.worker.model.parameters()).device)
    gen = property(lambda self: self.collector.gen)
    sampler = property(lambda self: self.collector.sampler)
    guard = property(lambda self: self.step_fn.guard)
    kl_ctl = property(lambda self: self.step_fn.kl_ctl)
    last_batch = property(lambda self: self.step_fn.last_batch)

    # the collector's parts, as the run's (tests and tools sample and score through the run)
    def collect(self):
        return self.collector.collect(self.step_idx)

    def sample(self, rows, streams=None):
        return self.collector.sample(rows, streams)

    def score(self, batch):
        return self.collector.score(batch)

    def step(self) -> dict:
        """One GRPO step; returns its metrics."""
        return self.step_fn(self.step_idx)

    def sync_weights(self, version: int | None = None) -> None:
        sync_weights(self.engine, self.worker, self.step_idx + 1 if version is None else version, self.comm)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        s = self.step_fn
        return {
            "step": self.step_idx, **self.worker.state_dict(), "kl_ctl": s.kl_ctl.state_dict(),
            **self.collector.state_dict(),
            "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state(), "py_rng": random.getstate(),
            **s.guard.state_dict(),
            "ref_probe": s.ref_probe.state_dict() if s.ref_probe is not None else None,
            "health": self.health.state_dict() if self.health is not None else None,
            "entropy_ctl": s.entropy_ctl.state_dict() if s.entropy_ctl is not None else None,
        }

    def load_state_dict(self, st: dict) -> None:
        s = self.step_fn
        self.step_idx = st["step"]
        self.worker.load_state_dict(st)
        s.kl_ctl.load_state_dict(st["kl_ctl"])
        self.collector.load_state_dict(st)
        torch.set_rng_state(st["torch_rng"])
        np.random.set_state(st["np_rng"])
        random.setstate(st["py_rng"])
        s.guard.load_state_dict(st)
        if s.entropy_ctl is not None and st.get("entropy_ctl") is not None:
            s.entropy_ctl.load_state_dict(st["entropy_ctl"])
            self.worker.entropy_coef = s.entropy_ctl.active
        if s.ref_probe is not None:
            s.ref_probe.load_state_dict(st.get("ref_probe"))
        if self.health is not None and st.get("health") is not None:
            self.health.load_state_dict(st["health"])

    # ------------------------------------------------------------------ checkpoints
    def save(self):
        """Checkpoint; it counts as healthy when no update was skipped since the previous one."""
        guard = self.step_fn.guard
        path = self.run.save(self.step_idx, self.worker, self.tokenizer, self.state_dict(),
                             healthy=not guard.bad_since_save)
        guard.bad_since_save = False
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
        """A run that does not resume: earlier output moved aside, the warnings of the run's set-up
        checks logged, the step-0 checkpoint saved and the baseline evaluation logged as step 0."""
        self.run.start_fresh()
        for line in self.fresh_notes():
            log.warning(line)
        if self.cfg.train.save_every or self.cfg.train.save_every_minutes:
            self.save()                  # step 0: a healthy point to roll back to
        if self.eval_dataset is not None:
            baseline = self.run_eval()   # held-out accuracy before training
            if baseline:
                self.run.sink.write(0, baseline)

    # ------------------------------------------------------------------ evaluation, keep_best
    def eval_due(self) -> bool:
        """Held-out evaluation after this step: every `train.eval_every` steps and after the last."""
        every = self.cfg.train.eval_every
        return self.eval_dataset is not None and (
            (every > 0 and self.step_idx % every == 0) or self.step_idx == self.cfg.train.steps)

    def run_eval(self) -> dict:
        if self.eval_dataset is None:
            return {}
        if self.checker is None:                     # a held-out set given after the run was built
            self.checker = build_checker(self.cfg, self.eval_dataset, say=self.comm.is_main,
                                         fns=dict(zip(self.rewards.names, self.rewards.fns)))
        out = held_out(self.engine, self.encoder, self.checker, self.eval_dataset, self.cfg,
                       seed=self.cfg.train.seed * 1_000_003 + self.step_idx, step=self.step_idx,
                       device=self.gen.device, episodes=self.collector.episodes)
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
            self.run.write_samples(self.step_idx, self.last_batch, self.encoder.text, self.tokenizer.decode)

    # ------------------------------------------------------------------ the loop
    def train(self, *, resume: bool = False, progress=None) -> dict:
        """Train to `train.steps` (or the time budget, or a stopping alarm); returns the last step's
        metrics. `progress(step, metrics)` after each step; by default a progress bar when
        `train.progress` (on the main rank). However it ends, the run's exit actions (`on_exit`: the
        report, leaving the job) run."""
        if resume and self.run.latest() is None:      # before anything is written (no report either)
            problem = nothing_to_resume(self.run.path, flag="resume=True")
            if problem is not None:
                raise ConfigError(problem)
            log.warning("resume: %s holds no complete checkpoint; starting over from step 0", self.run.path)
        try:
            if progress is None and self.cfg.train.progress and self.comm.is_main:   # the bar: rank 0
                from grpokit.cli_progress import StepProgress
                with StepProgress(self.cfg.train.steps, self.step_idx) as bar:
                    return self._train(resume, bar.update)
            return self._train(resume, progress)
        finally:
            for fn in self.on_exit:
                fn(self)

    def _train(self, resume: bool, progress) -> dict:
        cfg, comm = self.cfg, self.comm
        if not (resume and self.resume()):
            self.start_fresh()
        last: dict = {}
        started = self.clock() if cfg.train.max_minutes else 0.0
        while self.step_idx < cfg.train.steps:
            metrics = self.step()
            self.step_idx += 1
            out_of_time = bool(cfg.train.max_minutes) and self.clock() - started >= 60 * cfg.train.max_minutes
            out_of_time = comm.any(out_of_time)           # clocks differ: every rank stops after the same step
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
            stop = comm.any(self.health is not None and self.health.should_stop)   # rank 0 monitors
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
