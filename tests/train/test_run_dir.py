"""The run directory over several runs: a fresh run sets an earlier run's output aside (never
appends to it, never mixes checkpoints), a resume logs every step and alarm once, and the held-out
evaluation runs on the documented steps."""

import json
import logging
from pathlib import Path

import pytest
import torch

from grpokit.config import load_config
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("rundir"))


def _trainer(setup, run: Path, **over):
    _, model_dir, train, _ = setup
    opts = {"rewards": "[{name: test_varied}]", "algorithm.kl.beta": 0.05, "algorithm.kl.controller": "fixed", **over}
    return build_trainer(load_config(None, small_overrides(model_dir, train, run, **opts)))


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def test_a_fresh_run_sets_an_earlier_runs_output_aside(setup, caplog):
    """Two fresh runs into one directory: the second logs only its own rows, the first run's files
    (and config) are under previous/, and a resume after that loads the second run's checkpoint,
    not the first run's later one."""
    run = setup[0] / "twice"
    first = _trainer(setup, run, **{"train.steps": 2, "train.save_every": 1, "train.seed": 1})
    first.train()
    (run / "report.html").write_text("first run's report")
    (run / "tb").mkdir()                                   # as TensorBoard leaves it
    with caplog.at_level(logging.WARNING, logger="grpokit.train"):
        second = _trainer(setup, run, **{"train.steps": 1, "train.save_every": 1, "train.seed": 2})
        second.train()
    moved = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    [earlier] = (run / "previous").iterdir()
    assert len(moved) == 1 and str(earlier) in moved[0]

    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1]
    assert [r["step"] for r in _rows(earlier / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in (earlier / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000000", "step_000001"]
    assert (earlier / "report.html").read_text() == "first run's report" and (earlier / "tb").is_dir()
    assert (run / "report.html").read_text() != "first run's report" and not (run / "tb").exists()   # its own
    assert "seed: 1" in (earlier / "config.yaml").read_text() and "seed: 2" in (run / "config.yaml").read_text()

    resumed = _trainer(setup, run, **{"train.steps": 2, "train.save_every": 1, "train.seed": 2})
    assert resumed.resume() and resumed.step_idx == 1
    assert torch.equal(_weights(resumed.model), _weights(second.model))


def test_a_fresh_run_into_an_empty_directory_moves_nothing(setup):
    run = setup[0] / "empty"
    _trainer(setup, run, **{"train.steps": 1}).train()
    assert not (run / "previous").exists()


def test_resume_from_a_step0_checkpoint_logs_each_alarm_once(setup):
    """A run killed at step 2 whose only checkpoint is step 0 (empty health history) resumes from
    step 0: the alarms of the killed attempt are dropped, not logged a second time."""
    run = setup[0] / "alarms"
    over = {"train.steps": 3, "train.save_every": 100,              # only the step-0 checkpoint
            "health.entropy_collapse.recent": 1, "health.entropy_collapse.floor": 100.0}   # fires every step

    def die_at_2(step, m):
        if step == 2:
            raise KeyboardInterrupt("killed")
    with pytest.raises(KeyboardInterrupt):
        _trainer(setup, run, **over).train(progress=die_at_2)
    assert [a["step"] for a in _rows(run / "alarms.jsonl")] == [1, 2]
    _trainer(setup, run, **over).train(resume=True)
    assert [a["step"] for a in _rows(run / "alarms.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("every, steps, evaluated", [(0, 2, [0, 2]), (2, 3, [0, 2, 3])])
def test_held_out_evaluation_steps(setup, every, steps, evaluated):
    """Before the first step (row 0, holding only eval/* and time), then eval_every N: every N steps
    and after the last; 0: after the last only."""
    held = setup[3]
    run = setup[0] / f"eval{every}"
    _trainer(setup, run, **{"train.steps": steps, "train.eval_every": every, "data.eval_path": held,
                            "data.eval_size": 4}).train()
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/pass@1" in r] == evaluated
    if every == 0:
        assert set(rows[0]) == {"step", "time", "eval/pass@1"}
        assert [r["step"] for r in rows] == [0, 1, 2]


def test_setting_aside_is_finished_after_a_kill_in_the_middle(tmp_path):
    """A kill while moving leaves previous/.partial-*; the next start moves the rest into the same
    folder and names it, so the earlier run is never split and no checkpoint is left for --resume."""
    from grpokit.train.checkpoint import set_aside_earlier_run

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("seed: 1\n")
    partial = run / "previous" / ".partial-20261203T000000Z"
    partial.mkdir(parents=True)
    (run / "checkpoints").rename(partial / "checkpoints")           # the kill came after the first move
    (run / "previous" / "20261203T000000Z").mkdir()                  # ... or right before the rename
    done = set_aside_earlier_run(run)
    assert done == run / "previous" / "20261203T000000Z"
    assert sorted(p.name for p in done.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert not list((run / "previous").glob(".partial-*")) and not (run / "checkpoints").exists()
    assert set_aside_earlier_run(run) is None                         # nothing left to move


def test_two_set_asides_in_one_second_get_two_folders(tmp_path):
    from grpokit.train.checkpoint import set_aside_earlier_run

    run = tmp_path / "run"
    names = []
    for i in range(3):
        run.mkdir(exist_ok=True)
        (run / "metrics.jsonl").write_text(f'{{"step": {i}}}\n')
        names.append(set_aside_earlier_run(run).name)
    assert len(set(names)) == 3 and not (run / "metrics.jsonl").exists()


def test_a_small_batch_is_warned_about_outside_the_demo():
    from grpokit.config import load_config
    from grpokit.train.build import batch_advice

    msg = batch_advice(load_config(None, ["rollout.batch_size=16", "rollout.group_size=4"]))
    assert msg is not None and "rollout.batch_size=16" in msg and "512-2048" in msg and "\n" not in msg
    assert batch_advice(load_config(None, ["rollout.batch_size=512", "rollout.group_size=8"])) is None
    assert batch_advice(load_config(None, ["rollout.batch_size=16", "rollout.group_size=4",
                                           "train.batch_advice=false"])) is None
    assert batch_advice(load_config(["demo"], [])) is None          # 128 per step on a 2-core CPU, by design


def test_a_reward_drawing_unseeded_random_numbers_is_named_at_start(tmp_path, caplog):
    import logging
    import random

    from grpokit.config import load_config
    from grpokit.rewards import REGISTRY, register
    from grpokit.train import build_trainer
    from tests.fixtures import small_overrides, tiny_run_inputs

    if "test_coin_flip" not in REGISTRY:
        @register("test_coin_flip")
        def _coin(prompts, completions, **columns):
            return [float(random.random() < 0.5) for _ in completions]

    root, model_dir, train, _ = tiny_run_inputs(tmp_path)
    for name, named in (("test_coin_flip", True), ("exact_match", False)):
        caplog.clear()
        cfg = load_config(None, small_overrides(model_dir, train, root / name, **{
            "rewards": f"[{{name: {name}}}]", "train.steps": 1}))
        with caplog.at_level(logging.WARNING, logger="grpokit"):
            build_trainer(cfg, health=False).train()
        lines = [r.getMessage() for r in caplog.records if "not deterministic" in r.getMessage()]
        assert bool(lines) == named and all("test_coin_flip" in x for x in lines)
