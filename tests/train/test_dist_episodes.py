"""Multi-turn episodes under torchrun: each rank plays its own groups' episodes, every group from its
own seeded streams (a turn's from its group's seed, its place in the group and the turn), so 2 DDP
ranks play and score the episodes that 1 process plays, step by step, and train on them."""

from __future__ import annotations

import json

import pytest

from tests.fixtures import small_overrides
from tests.train import torchrun
from tests.train.test_episodes_training import episode_inputs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    _, model_dir, data, _ = episode_inputs(tmp_path_factory.mktemp("dist_episodes"))
    return model_dir, data


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_play_the_episodes_one_process_plays(tmp_path, inputs):
    model_dir, data = inputs
    rows = {}
    for world in (2, 1):
        run_dir, out = tmp_path / f"run{world}", tmp_path / f"out{world}"
        argv = ["train", *small_overrides(model_dir, data, run_dir, **{
            "rollout.env": "tests.rollout.agent_envs:AgainEnv", "rollout.agent.max_turns": 3,
            "rollout.max_new_tokens": 60, "rollout.group_size": 2, "rollout.batch_size": 8, "optim.micro_batch_size": 4,
            "rewards": "[{name: digit_parity}]", "train.steps": 3, "train.distributed": "ddp", "optim.lr": 1e-2,
            "train.dist_timeout_s": 60, "train.check_rewards": "false", "train.batch_advice": "false"})]
        torchrun.run(world, torchrun.program("train_parity", out, *argv), timeout=180)
        assert [(out / f"rank{r}.exit").read_text() for r in range(world)] == ["0"] * world
        rows[world] = _rows(run_dir)
    assert [r["step"] for r in rows[2]] == [1, 2, 3]
    for a, b in zip(rows[2], rows[1]):
        for k in ("reward/mean", "completion/length_mean", "agent/turns_mean", "agent/obs_token_frac",
                  "agent/stop_max_turns"):
            assert a[k] == pytest.approx(b[k], rel=1e-9), (a["step"], k)
        assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-6)
    assert any(r["agent/turns_mean"] > 1 and r["agent/obs_token_frac"] > 0 for r in rows[2])     # several turns
