"""Atomic checkpoints: written to a temporary folder, fsynced, then renamed into place.

Layout: RUN_DIR/checkpoints/step_000010/ holds a loadable Hugging Face model directory (so
`grpokit eval --model` works on it) plus `trainer_state.pt` (optimizer, scheduler, KL controller,
data position, RNG states, step). A folder without its `COMPLETE` marker is never used, so a process
killed mid-write leaves the previous checkpoint as the latest; a folder being deleted is first
renamed away, so no `step_*` folder is ever half-deleted either. The last *healthy* checkpoint (no
update skipped by the non-finite guard since the one before it), named in `checkpoints/HEALTHY`, is
kept apart from the last K; it is where `Trainer.rollback` goes.

A LoRA policy's checkpoint holds its adapters (`lora.save: adapter`; `grpokit eval` finds the base
through adapter_config.json) or the merged model plus the adapters in `adapter/` (`merged`); resume
and rollback load the adapters (grpokit.models.lora).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from grpokit.models.lora import is_peft, load_adapter_weights, save_policy

MARKER = "COMPLETE"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _write_atomic(path: Path, text: str) -> None:
    """Write a small file so that a reader sees the old or the new content, never a partial one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _discard(root: Path, ckpt: Path) -> None:
    """Delete a checkpoint folder: first renamed out of `step_*` (one atomic step), then removed, so
    a process killed while deleting never leaves a `step_*` folder with some files gone."""
    trash = root / f".trash_{ckpt.name}_{os.getpid()}"
    try:
        os.replace(ckpt, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def temp_checkpoint(run_dir: Path, step: int, job: int | None = None) -> Path:
    """A fresh, empty temporary folder for the checkpoint of `step` (`job`: a number every rank of
    a job agrees on, e.g. rank 0's pid; default this process's)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{step:06d}_{os.getpid() if job is None else job}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict, *, keep_last: int = 2,
                    healthy: bool = True, merged: bool = False, keep_healthy: int = 1,
                    save_weights=None, tmp: Path | None = None) -> Path:
    """Write RUN_DIR/checkpoints/step_NNNNNN atomically: into `.tmp_step_*`, every file fsynced, the
    COMPLETE marker last, then one rename. Returns the checkpoint's path. `save_weights(folder)`
    writes the policy (a training worker's own saving, e.g. gathered from shards); by default
    `model`'s. `tmp`: a `temp_checkpoint` folder the weights were already written into (by every
    rank of a sharded run); then only the rest is written here."""
    root = Path(run_dir) / "checkpoints"
    final = checkpoint_path(run_dir, step)
    if tmp is None:
        tmp = temp_checkpoint(run_dir, step)
    elif save_weights is not None:
        raise ValueError("save_checkpoint: give either tmp (weights written) or save_weights")
    else:
        save_weights = lambda folder: None      # noqa: E731 - already in tmp
    if save_weights is not None:
        save_weights(tmp)
    else:                                       # a LoRA policy: adapters, or merged + adapter/ (lora.save)
        save_policy(model, tmp, merged=merged)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / "trainer_state.pt")
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    (tmp / MARKER).write_text(json.dumps({"step": step, "healthy": healthy}))
    with open(tmp / MARKER, "rb") as fh:
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if final.exists():          # the same step saved again (e.g. step 0 of a restarted run)
        _discard(root, final)
    os.replace(tmp, final)
    _fsync_dir(root)
    if healthy:
        _write_atomic(root / "HEALTHY", final.name)
    _prune(root, keep_last, keep_healthy)
    return final


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / MARKER).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def healthy_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    marker = root / "HEALTHY"
    if marker.is_file():
        p = root / marker.read_text().strip()
        if (p / MARKER).is_file():
            return p
    return None


def healthy_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints marked healthy, oldest first."""
    out = []
    for p in list_checkpoints(run_dir):
        try:
            if json.loads((p / MARKER).read_text()).get("healthy", True):
                out.append(p)
        except (OSError, ValueError):
            continue
    return out


def _prune(root: Path, keep_last: int, keep_healthy: int = 1) -> None:
    """Keep the newest `keep_last` checkpoints, the newest `keep_healthy` healthy ones and the one
    HEALTHY names; discard the rest."""
    keep = set(list_checkpoints(root.parent)[-keep_last:])
    keep |= set(healthy_checkpoints(root.parent)[-max(keep_healthy, 1):])
    healthy = healthy_checkpoint(root.parent)
    for p in list_checkpoints(root.parent):
        if p not in keep and p != healthy:
            _discard(root, p)
    for stale in [*root.glob(".tmp_step_*"), *root.glob(".trash_step_*")]:   # left by a killed process
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".HEALTHY.*.tmp"):
        stale.unlink(missing_ok=True)


EARLIER_RUN_OUTPUT = ("checkpoints", "metrics.jsonl", "guard.jsonl", "alarms.jsonl", "disagreements.jsonl",
                      "samples", "report.html", "tb", "config.yaml", "best", "health_config.json")
"""What a run writes into its run directory; on a fresh start these belong to an earlier run and are
moved aside (`set_aside_earlier_run`). Checkpoints first: once they are gone, a `--resume` can no
longer pick up the earlier run, whatever else a kill leaves behind."""


def nothing_to_resume(run_dir: Path, flag: str = "--resume") -> str | None:
    """Why resuming in `run_dir` cannot work, in one line, or None when it can: a complete
    checkpoint to continue from, or at least an earlier run's output (a run stopped before its
    first checkpoint starts over, its output moved aside). Resuming into a directory holding
    neither is a mistaken path or a first run, never a silent fresh start."""
    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is not None or any((run_dir / n).exists() for n in EARLIER_RUN_OUTPUT):
        return None
    where = "does not exist" if not run_dir.exists() else "holds no checkpoint and no earlier run"
    return (f"{flag}: nothing to resume: {run_dir} {where} (check train.run_dir; "
            f"to start a fresh run, leave out {flag})")


def _new_dir(parent: Path, name: str) -> Path:
    """Create parent/name, or parent/name-1, -2, ... when taken (two starts in one second, or two
    processes at once); never raises for a name that exists."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = parent / (name if n == 0 else f"{name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: no free name for {name}")


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """Move the output of an earlier run out of `run_dir` into `run_dir/previous/<UTC time>/`, so a
    fresh run neither appends to its logs nor mixes its checkpoints with the earlier ones (a later
    `--resume` would load them). Nothing is deleted. Returns the folder the output went to, or None
    when there was none.

    Crash-safe: the files go into `previous/.partial-<time>/` first and the folder is renamed when
    all are in; a start after a kill in the middle finishes the move into the same folder."""
    import datetime as dt

    run_dir = Path(run_dir)
    prev = run_dir / "previous"
    partial = min(prev.glob(".partial-*"), default=None) if prev.is_dir() else None
    found = [run_dir / name for name in EARLIER_RUN_OUTPUT if (run_dir / name).exists()]
    if not found and partial is None:
        return None
    if partial is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        partial = _new_dir(prev, f".partial-{stamp}")
    for path in found:
        try:
            os.replace(path, partial / path.name)
        except FileNotFoundError:             # another process starting in this directory moved it
            pass
    _fsync_dir(run_dir)
    name = partial.name.removeprefix(".partial-")
    try:                                      # an empty one left by a kill right before the rename
        (prev / name).rmdir()
    except OSError:
        pass
    final = _new_dir(prev, name)
    os.replace(partial, final)                # an empty directory is replaced atomically
    _fsync_dir(prev)
    return final


def load_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False)


def load_weights(model, ckpt: Path) -> None:
    """Load the policy weights of a checkpoint into `model` in place (a LoRA policy: its adapters)."""
    from safetensors.torch import load_file

    if is_peft(model):
        return load_adapter_weights(model, ckpt)

    files = sorted(Path(ckpt).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{ckpt}: weights do not match the model (missing {sorted(set(missing) - tied)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]})")


def optimizer_state_by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state as `torch.optim.Optimizer.load_state_dict` takes it (parameters numbered
    in order) for an optimizer over the parameters `names`. A state keyed by parameter name (what
    `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` gives a data-parallel run,
    and what lets a checkpoint move between world sizes) is renumbered; a numbered one is returned
    as it is."""
    groups = state.get("param_groups", [])
    if not any(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted({p for g in groups for p in g["params"]} - set(index))
    if unknown:
        raise RuntimeError(f"optimizer state names parameters this model does not train: {unknown[:3]}")
    return {"state": {index[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in groups]}


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """The inverse of `optimizer_state_by_index`: a numbered optimizer state keyed by the names of
    the optimizer's parameters, in order (a name-keyed one is returned as it is)."""
    groups = state.get("param_groups", [])
    if any(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    return {"state": {names[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[p] for p in g["params"]]} for g in groups]}
