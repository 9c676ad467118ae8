"""`rollout.async`: one-step-off-policy overlap with a rollout server. Every batch after the first
is one step stale and says so (`rollout/staleness`); prompts, rewards and advantages stay with the
batch they were generated for (the same prompts per step as on-policy); the importance weights see
the gap; a checkpoint keeps the request in flight and a resumed run generates it again."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs, varied_trainer
from tests.rollout.server_proc import ServerProcess
from tests.rollout.test_server import served


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("async"))


def _trainer(setup, name, address, **extra):
    return varied_trainer(setup, name, **{"rollout.engine": "server", "rollout.server": address,
                                          "rollout.server_timeout_s": 60, "train.steps": 4, **extra})


def _record(tr, stop_after: int | None = None) -> list[dict]:
    """Train; per step: the prompts' dataset indices and the logged metrics."""
    out = []

    def progress(step, metrics):
        b = tr.last_batch
        for i in range(len(b)):          # every row's completion was generated for its own prompt
            assert b.prompt_ids[i] == tr.encoder.encode(b.rows[i]["prompt"])
        out.append({"idx": b.prompt_index.tolist(), **metrics})
        if step == stop_after:
            raise KeyboardInterrupt      # a crash right after the step's checkpoint

    try:
        tr.train(progress=progress)
    except KeyboardInterrupt:
        pass
    return out


def test_async_batches_are_one_step_stale_hold_their_own_prompts_and_are_corrected(setup):
    _, model_dir, _, _ = setup
    with served(model_dir) as (address, _):
        on = _record(_trainer(setup, "on_policy", address))
        off_tr = _trainer(setup, "async", address, **{"rollout.async": True})
        off = _record(off_tr)
        off_tr.engine.close()
    assert [m["rollout/staleness"] for m in on] == [0.0, 0.0, 0.0, 0.0]
    assert [m["rollout/staleness"] for m in off] == [0.0, 1.0, 1.0, 1.0]
    assert [m["idx"] for m in off] == [m["idx"] for m in on]          # the same prompts, step by step
    # on-policy, sampler and trainer agree; one step stale, the weights moved and the ratio sees it
    assert max(m["rollout/logprob_diff_max"] for m in on) < 1e-4
    assert off[0]["rollout/logprob_diff_max"] < 1e-4
    assert all(m["rollout/logprob_diff_mean"] > 1e-3 for m in off[1:])
    assert all(m["rollout/is_weight_mean"] != pytest.approx(1.0, abs=1e-6) for m in off[1:])


def test_a_checkpoint_keeps_the_request_in_flight_and_resume_generates_it_again(setup):
    _, model_dir, _, _ = setup
    with served(model_dir) as (address, _):
        whole = _record(_trainer(setup, "async_whole", address, **{"rollout.async": True}))
        first = _record(_trainer(setup, "async_cut", address, **{"rollout.async": True, "train.save_every": 2}),
                        stop_after=2)
        assert len(first) == 2
        resumed_tr = _trainer(setup, "async_cut", address, **{"rollout.async": True, "train.save_every": 2})
        resumed = []

        def progress(step, metrics):
            resumed.append({"idx": resumed_tr.last_batch.prompt_index.tolist(), **metrics})

        resumed_tr.train(resume=True, progress=progress)
        resumed_tr.engine.close()
    assert [m["idx"] for m in first + resumed] == [m["idx"] for m in whole]
    assert [m["rollout/staleness"] for m in resumed] == [0.0, 1.0]   # regenerated with the checkpoint's weights


def test_async_needs_an_engine_that_generates_in_the_background(setup):
    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "async_hf", **{"rollout.async": True}))
    with pytest.raises(ConfigError, match="rollout.async needs an engine"):
        build_trainer(cfg, health=False)


@pytest.mark.slow
def test_async_training_teaches_the_demo_task(tmp_path, demo_warm_dir):
    """The embedded demo task, short, with its rollouts from a server process one step off-policy:
    held-out greedy accuracy rises and every step after the first logs staleness 1."""
    from grpokit.demo import run_demo

    warm = tmp_path / demo_warm_dir.name
    shutil.copytree(demo_warm_dir, warm)                              # run_demo reuses it
    random.seed(0)
    with ServerProcess(warm, tmp_path / "server.log") as srv:
        out = run_demo(quick=True, run_dir=tmp_path, say=lambda *a: None, progress=False, overrides=[
            "rollout.engine=server", f"rollout.server={srv.address}", "rollout.async=true", "train.steps=30",
            "train.eval_every=0"])
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    staleness = [r["rollout/staleness"] for r in rows if "rollout/staleness" in r]
    assert staleness[0] == 0.0 and set(staleness[1:]) == {1.0} and len(staleness) == 30
    assert out["accuracy_after"] >= out["accuracy_before"] + 10.0
