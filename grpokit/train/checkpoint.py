"""Atomic checkpoints: written to a temporary folder, fsynced, then renamed into place.

Layout: RUN_DIR/checkpoints/step_000010/ holds a loadable Hugging Face model directory (so
`grpokit eval --model` works on it) plus `trainer_state.pt` (optimizer, scheduler, KL controller,
data position, RNG states, step). A folder without its `COMPLETE` marker is never used, so a process
killed mid-write leaves the previous checkpoint as the latest. `healthy` checkpoints (the last one
written while no guard had fired) are kept apart from the last K.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

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


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict, *, keep_last: int = 2,
                    healthy: bool = True) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / "trainer_state.pt")
    (tmp / MARKER).write_text(json.dumps({"step": step, "healthy": healthy}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    if healthy:
        (root / "HEALTHY").write_text(final.name)
    _prune(root, keep_last)
    return final


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


def _prune(root: Path, keep_last: int) -> None:
    keep = set(list_checkpoints(root.parent)[-keep_last:])
    healthy = healthy_checkpoint(root.parent)
    for p in list_checkpoints(root.parent):
        if p not in keep and p != healthy:
            shutil.rmtree(p, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):         # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)


def load_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False)


def load_weights(model, ckpt: Path) -> None:
    """Load the policy weights of a checkpoint into `model` in place."""
    from safetensors.torch import load_file

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
