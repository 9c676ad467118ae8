"""Checkpoints survive a killed process: never half-written, never half-deleted; `--resume` continues
from the last complete one.

The fast tests drive `grpokit.train.checkpoint` directly and simulate a death (an exception) at the
worst moment. The slow ones run `grpokit train` in a subprocess, SIGKILL it (once between
checkpoints, once while `trainer_state.pt` is half-written), resume it with `--resume` and check
that it continues from the last complete checkpoint, loses at most one checkpoint interval, logs
every step once, leaves nothing half-written on disk and ends where an uninterrupted run ends.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpokit.config import load_config
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train import build_trainer
from grpokit.train import checkpoint as ckpt_lib
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir

REPO = Path(__file__).resolve().parents[2]


def _tiny():
    tok = build_char_tokenizer("0123456789+= ")
    return build_tiny_model(tok, hidden=16, layers=1, heads=2, intermediate=32, max_positions=32, seed=0), tok


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _save(run, step, model, tok, healthy=True, keep_last=2):
    return ckpt_lib.save_checkpoint(run, step, model, tok, {"step": step, "blob": torch.arange(1000)},
                                    keep_last=keep_last, healthy=healthy)


def _assert_all_loadable(run: Path, model_factory) -> list[int]:
    """Every `step_*` folder is complete and loads; nothing temporary is left. Returns the steps."""
    root = run / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert not [n for n in names if n.startswith(".")], names      # no .tmp_step_*, .trash_*, .HEALTHY.*
    steps = []
    for p in sorted(root.glob("step_*")):
        assert (p / ckpt_lib.MARKER).is_file(), p
        state = ckpt_lib.load_state(p)
        assert state["step"] == int(p.name.split("_")[1])
        ckpt_lib.load_weights(model_factory(), p)
        steps.append(state["step"])
    return steps


# ---------------------------------------------------------------------------------------- fast

def test_keep_last_k_plus_the_last_healthy(tmp_path):
    model, tok = _tiny()
    _save(tmp_path, 1, model, tok, healthy=True)
    for step in (2, 3, 4):
        _save(tmp_path, step, model, tok, healthy=False)
    assert [p.name for p in ckpt_lib.list_checkpoints(tmp_path)] == ["step_000001", "step_000003", "step_000004"]
    assert ckpt_lib.healthy_checkpoint(tmp_path).name == "step_000001"
    assert ckpt_lib.latest_checkpoint(tmp_path).name == "step_000004"
    _save(tmp_path, 5, model, tok, healthy=True)
    assert [p.name for p in ckpt_lib.list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    assert ckpt_lib.healthy_checkpoint(tmp_path).name == "step_000005"
    assert _assert_all_loadable(tmp_path, lambda: _tiny()[0]) == [4, 5]


def test_a_death_while_writing_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    model, tok = _tiny()
    _save(tmp_path, 1, model, tok)
    real_save = torch.save

    def dying_save(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        with open(path, "r+b") as f:                       # half of trainer_state.pt is on disk
            f.truncate(os.path.getsize(path) // 2)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt_lib.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, tok)
    monkeypatch.setattr(ckpt_lib.torch, "save", real_save)
    assert [p.name for p in (tmp_path / "checkpoints").glob(".tmp_step_000002_*")]   # the remains
    assert ckpt_lib.latest_checkpoint(tmp_path).name == "step_000001"
    ckpt_lib.load_state(ckpt_lib.latest_checkpoint(tmp_path))
    _save(tmp_path, 3, model, tok)                         # the next save clears the remains
    assert _assert_all_loadable(tmp_path, lambda: _tiny()[0]) == [1, 3]


def test_a_death_while_deleting_never_leaves_a_half_deleted_checkpoint(tmp_path, monkeypatch):
    """Pruning renames a folder out of `step_*` before removing it, so a death halfway through
    the removal leaves only loadable checkpoints behind."""
    model, tok = _tiny()
    for step in (1, 2):
        _save(tmp_path, step, model, tok, keep_last=2)
    real_rmtree = ckpt_lib.shutil.rmtree

    def dying_rmtree(path, *a, **k):
        next(Path(path).glob("*.safetensors")).unlink()     # one file gone ...
        raise KeyboardInterrupt("killed")                  # ... and the process dies

    monkeypatch.setattr(ckpt_lib.shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, model, tok, keep_last=2)         # prunes step 1
    monkeypatch.setattr(ckpt_lib.shutil, "rmtree", real_rmtree)
    for p in ckpt_lib.list_checkpoints(tmp_path):
        ckpt_lib.load_weights(_tiny()[0], p)
    assert [p.name for p in ckpt_lib.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    _save(tmp_path, 4, model, tok, keep_last=2)
    assert _assert_all_loadable(tmp_path, lambda: _tiny()[0]) == [3, 4]


def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    model, tok = _tiny()
    _save(tmp_path, 0, model, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _save(tmp_path, 0, model, tok)
    fresh = _tiny()[0]
    ckpt_lib.load_weights(fresh, tmp_path / "checkpoints" / "step_000000")
    assert torch.equal(_weights(fresh), _weights(model))
    assert _assert_all_loadable(tmp_path, lambda: _tiny()[0]) == [0]


def test_resume_without_a_checkpoint_starts_over_without_repeating_rows(tmp_path):
    """A run killed before its first checkpoint (save_every = 0) restarts from step 0 on --resume;
    the rows it had logged are moved aside (to previous/) so each step is logged once."""
    model_dir = tiny_model_dir(tmp_path / "model")
    train, _ = arithmetic_files(tmp_path / "data", n_train=64)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "guard.jsonl").write_text('{"event": "skip", "step": 2}\n')
    cfg = load_config(None, small_overrides(model_dir, train, run, **{"rewards": "[{name: test_varied}]"}))
    tr = build_trainer(cfg)
    tr.train(resume=True)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)
    assert not (run / "guard.jsonl").exists()
    [earlier] = (run / "previous").iterdir()
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (earlier / "guard.jsonl").read_text() == '{"event": "skip", "step": 2}\n'


# ---------------------------------------------------------------------------------------- slow

LAUNCHER = """
import os, sys, time, types
from pathlib import Path
sys.path.insert(0, {repo!r})
import tests.fixtures                                   # registers the test_varied reward
stall = os.environ.get("GRPOKIT_TEST_STALL_AT")
if stall:
    import torch
    from grpokit.train import checkpoint as ckpt

    def stalling_save(obj, path, *a, **k):
        torch.save(obj, path, *a, **k)
        if obj.get("step") == int(stall):
            with open(path, "r+b") as f:                 # half of trainer_state.pt is written ...
                f.truncate(os.path.getsize(path) // 2)
            (Path(path).parents[2] / "STALLED").touch()
            time.sleep(600)                              # ... when the SIGKILL comes

    ckpt.torch = types.SimpleNamespace(save=stalling_save, load=torch.load)
from grpokit.cli import main
sys.exit(main(sys.argv[1:]))
"""

STEPS, SAVE_EVERY = 8, 2


@pytest.fixture(scope="module")
def killed_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    model_dir = tiny_model_dir(root / "model")
    train, _ = arithmetic_files(root / "data", n_train=128)
    extra = {"rewards": "[{name: test_varied}]", "train.steps": STEPS, "train.save_every": SAVE_EVERY,
             "train.keep_last": 2, "algorithm.kl.beta": 0.05}
    straight = build_trainer(load_config(None, small_overrides(model_dir, train, root / "straight", **extra)))
    straight.train()
    return root, model_dir, train, extra, straight


def _launch(args: list[str], env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER.format(repo=str(REPO)), "train", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the training process")
        time.sleep(0.01)


def _steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass                                         # a row cut by the kill
    return out


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["between_checkpoints", "during_checkpoint_write"])
def test_sigkill_then_resume_continues_from_the_last_complete_checkpoint(killed_setup, moment):
    root, model_dir, train, extra, straight = killed_setup
    run = root / moment
    args = small_overrides(model_dir, train, run, **extra)
    ckdir = run / "checkpoints"
    if moment == "between_checkpoints":
        proc = _launch(args)
        _wait_for(lambda: (ckdir / "step_000004" / ckpt_lib.MARKER).is_file(), proc)
    else:
        proc = _launch(args, {"GRPOKIT_TEST_STALL_AT": "4"})
        _wait_for(lambda: (run / "STALLED").is_file(), proc)
        assert list(ckdir.glob(".tmp_step_000004_*")) and not (ckdir / "step_000004").exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()

    last_complete = ckpt_lib.latest_checkpoint(run)
    resumed_from = int(last_complete.name.split("_")[1])
    done_before_kill = max(_steps_logged(run))
    assert done_before_kill - resumed_from <= SAVE_EVERY                 # at most one interval lost
    if moment == "during_checkpoint_write":
        assert (resumed_from, done_before_kill) == (2, 4)

    res = subprocess.run([sys.executable, "-c", LAUNCHER.format(repo=str(REPO)), "train", *args, "--resume"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(r"resumed from (\S+) \(step (\d+)\)", res.stderr)
    assert m and int(m.group(2)) == resumed_from and Path(m.group(1)).name == last_complete.name

    assert _steps_logged(run) == list(range(1, STEPS + 1))                # every step exactly once
    tok_dir = model_dir
    steps = _assert_all_loadable(run, lambda: _load(tok_dir))
    assert steps[-1] == STEPS
    # the kill cost time, nothing else: the end state is the uninterrupted run's
    final = _load(tok_dir)
    ckpt_lib.load_weights(final, ckdir / f"step_{STEPS:06d}")
    torch.testing.assert_close(_weights(final), _weights(straight.model), atol=1e-5, rtol=1e-4)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, ref):
        for k in ("reward/mean", "loss/policy", "kl/ref"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)


def _load(model_dir: Path):
    from grpokit.models.hf import load_model
    return load_model(model_dir, dtype="float32", device="cpu")
