"""The run directory: metrics, config, checkpoints, guard events, sample dumps, and rollback.

RUN_DIR/
  config.yaml          the config this run trains with (written once the directory is this run's)
  metrics.jsonl        one row per step (grpokit.monitor.sinks), TensorBoard in tb/ when installed
  guard.jsonl          the non-finite guard's skips and rollbacks
  alarms.jsonl, health_config.json   the health monitor's alarms and the thresholds it used
  samples/step_N.jsonl prompts, completions, rewards and advantages of a step
  checkpoints/step_N   atomic checkpoints (grpokit.train.checkpoint); HEALTHY names the last sound one
  best/                with `train.keep_best`: the policy of the best validation score (best.json)
  previous/<time>/     an earlier run's output, moved aside by a fresh start (never deleted)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from grpokit.config import dump_config
from grpokit.monitor.sinks import MetricSink, atomic_write_text, open_sink, truncate_jsonl
from grpokit.train import checkpoint as ckpt_lib
from grpokit.train.batch import Batch

log = logging.getLogger("grpokit.train")


class RunDir:
    """The run's files. `comm` (grpokit.train.comm): only its main rank writes, and every rank waits
    at a checkpoint until it is complete (one process: rank 0 of 1, so it writes and never waits)."""

    def __init__(self, cfg, comm=None):
        from grpokit.train.comm import LocalComm

        self.cfg, self.comm = cfg, comm if comm is not None else LocalComm()
        self.writer = self.comm.is_main
        self.path = Path(cfg.train.run_dir)
        if self.writer:
            self.path.mkdir(parents=True, exist_ok=True)
        self.sink = self._new_sink()

    def _new_sink(self) -> MetricSink:
        return open_sink(self.path, self.cfg) if self.writer else _NoSink()

    def _barrier(self) -> None:
        self.comm.barrier()

    def write_config(self) -> None:
        """RUN_DIR/config.yaml: the config this run trains with."""
        if self.writer:
            atomic_write_text(self.path / "config.yaml", dump_config(self.cfg))

    def start_fresh(self) -> None:
        """A run that does not resume: an earlier run's output is moved to RUN_DIR/previous/<UTC
        time>/ (never appended to, never deleted), then this run's config is written."""
        if not self.writer:
            return self._barrier()
        self.sink.close()                # it may hold RUN_DIR/tb open, which moves too
        moved = ckpt_lib.set_aside_earlier_run(self.path)
        self.write_config()
        self.sink = self._new_sink()
        if moved is not None:
            log.warning("%s held the output of an earlier run; moved it to %s", self.path, moved)
        self._barrier()

    def latest(self) -> Path | None:
        return ckpt_lib.latest_checkpoint(self.path)

    def resumed(self, step: int) -> None:
        """After loading a checkpoint of `step`: drop the log rows written after it (the steps
        will be redone, and logged once) and record the config."""
        if not self.writer:
            return
        self.sink.truncate_after(step)
        truncate_jsonl(self.path / "guard.jsonl", step)   # alarms.jsonl: the health monitor's own
        self.write_config()

    def save(self, step: int, worker, tokenizer, state: dict, *, healthy: bool) -> Path:
        """Checkpoint of the worker's policy and the run's state; `healthy` marks it as a point to
        roll back to. Data-parallel: every rank calls it (the weights are gathered), rank 0 writes,
        and all return once the checkpoint is complete."""
        merged = self.cfg.lora.save == "merged"
        if getattr(worker, "sharded_checkpoints", False):   # FSDP2: every rank writes its shards (DCP)
            return self._save_sharded(step, worker, tokenizer, state, healthy=healthy)
        if not self.writer:
            worker.save_weights(None, merged=merged)       # its part of the gathering
            self._barrier()
            return ckpt_lib.checkpoint_path(self.path, step)
        path = ckpt_lib.save_checkpoint(self.path, step, worker.model, tokenizer, state,
                                        keep_last=self.cfg.train.keep_last, keep_healthy=self.cfg.train.keep_healthy,
                                        healthy=healthy, merged=merged,
                                        save_weights=lambda d: worker.save_weights(d, merged=merged))
        self._barrier()
        return path

    def _save_sharded(self, step: int, worker, tokenizer, state: dict, *, healthy: bool) -> Path:
        """A sharded checkpoint: rank 0 makes the temporary folder, every rank writes its shards
        into it (torch.distributed.checkpoint), then rank 0 adds the tokenizer and driver state,
        the marker, and renames it into place. Every rank returns once it is complete."""
        job = self.comm.gather(os.getpid())[0]            # one temporary folder name for the job
        tmp = ckpt_lib.checkpoint_path(self.path, step).parent / f".tmp_step_{step:06d}_{job}"
        if self.writer:
            tmp = ckpt_lib.temp_checkpoint(self.path, step, job)
        self._barrier()
        worker.save_weights(tmp)
        self._barrier()
        if self.writer:
            ckpt_lib.save_checkpoint(self.path, step, worker.model, tokenizer, state, tmp=tmp,
                                     keep_last=self.cfg.train.keep_last, keep_healthy=self.cfg.train.keep_healthy,
                                     healthy=healthy)
        self._barrier()
        return ckpt_lib.checkpoint_path(self.path, step)

    def save_best(self, step: int, worker, tokenizer, score: float) -> Path:
        """RUN_DIR/best/: the policy as a Hugging Face directory and `best.json` ({step, score}),
        written into a temporary folder and then swapped in (a kill leaves the earlier best in
        `best/` or `.old_best/`)."""
        final, tmp = self.path / "best", self.path / ".tmp_best"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        worker.save_weights(tmp, merged=self.cfg.lora.save == "merged")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "best.json").write_text(json.dumps({"step": step, "score": score}) + "\n")
        old = self.path / ".old_best"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    def read_best(self) -> dict | None:
        """RUN_DIR/best/best.json ({step, score}), or None when there is no best policy yet."""
        path = self.path / "best" / "best.json"
        if not path.is_file():
            return None
        try:
            best = json.loads(path.read_text())
            return {"step": int(best["step"]), "score": float(best["score"])}
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s unreadable (%s); the best policy is chosen afresh", path, e)
            return None

    def event(self, row: dict) -> None:
        if not self.writer:
            return
        with (self.path / "guard.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def write_samples(self, step: int, batch: Batch, prompt_text, decode=None) -> None:
        """RUN_DIR/samples/step_N.jsonl: one row per completion of the step's batch (rank 0's). A
        multi-turn episode's row also holds `spans`, its text cut where the policy's turns and the
        observations (never trained on) alternate, and its stop reason and tool counts."""
        if not self.writer:
            return
        d = self.path / "samples"
        d.mkdir(exist_ok=True)
        with (d / f"step_{step:06d}.jsonl").open("w") as f:
            for i in range(len(batch)):
                row = batch.rows[i]
                f.write(json.dumps({
                    "step": step, "uid": batch.uid[i], "group": int(batch.group_id[i]),
                    "prompt": prompt_text(row["prompt"]), "completion": batch.completions[i],
                    "answer": row.get("answer"), "reward": float(batch.rewards[i]),
                    "rewards": {k: v[i] for k, v in batch.scores.items()},
                    "advantage": float(batch.advantages[i]), "length": int(batch.lengths[i]),
                    "finish_reason": batch.finish_reason[i], **_episode_fields(batch, i, decode)}) + "\n")

    def close(self) -> None:
        self.sink.close()


def _episode_fields(batch: Batch, i: int, decode) -> dict:
    """A multi-turn episode's spans ({"trained": bool, "text": ...}) and record, for a sample dump."""
    if batch.episodes is None:
        return {}
    rec = batch.episodes[i]
    out = {k: rec[k] for k in ("stop_reason", "turns", "tool_calls", "tool_errors", "parse_failures")}
    if decode is not None:
        n = int(batch.mask[i].sum())
        ids, act = batch.completion_ids[i, :n].tolist(), batch.action_mask[i, :n].tolist()
        spans, start = [], 0
        for j in range(1, n + 1):
            if j == n or act[j] != act[start]:
                spans.append({"trained": bool(act[start]), "text": decode(ids[start:j])})
                start = j
        out["spans"] = spans
    return out


class _NoSink:
    """The metric sink of a rank that does not write (rank 0 writes the reduced metrics)."""

    def write(self, step: int, metrics: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def rollback(run: RunDir, worker, kl_ctl, guard, cause: str, step: int, entropy_ctl=None) -> None:
    """Reload the last healthy checkpoint's weights and optimizer into the worker and its KL
    controller state; lower the learning rate by `guard.rollback_lr_factor`. The data position and
    RNG move on, so the same batch is not replayed. Raises when there is nothing to roll back to
    or `guard.max_rollbacks` is spent."""
    g = run.cfg.guard
    ck = ckpt_lib.healthy_checkpoint(run.path)
    if ck is None or guard.rollbacks >= g.max_rollbacks:
        why = "no healthy checkpoint to roll back to" if ck is None else f"{guard.rollbacks} rollbacks already"
        raise RuntimeError(f"training diverged ({cause}); {why}. Lower optim.lr or check the rewards.")
    worker.load_weights(ck)
    state = ckpt_lib.load_state(ck)
    worker.load_optimizer_state(state["optimizer"])
    kl_ctl.load_state_dict(state["kl_ctl"])
    if entropy_ctl is not None and state.get("entropy_ctl") is not None:
        entropy_ctl.load_state_dict(state["entropy_ctl"])
        worker.entropy_coef = entropy_ctl.active
    worker.scale_lr(g.rollback_lr_factor)
    guard.rolled_back()
    log.warning("rolled back to %s after %d bad steps (%s); learning rate x%g", ck.name,
                g.max_consecutive_bad, cause, g.rollback_lr_factor)
    run.event({"event": "rollback", "step": step, "to": ck.name, "cause": cause,
               "lr_factor": g.rollback_lr_factor})


def rss_mb() -> float:
    """Resident memory of this process in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
