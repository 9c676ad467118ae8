"""Multi-turn episodes under torchrun: each rank plays its own groups' episodes, every group from its
own seeded streams (a turn's from its group's seed, its place in the group and the turn), so 2 DDP
ranks play and score the episodes that 1 process plays, step by step, and train on them; and 2 ranks
whose turns a rollout server generates (three processes) play the same episodes again."""

from __future__ import annotations

import json

import pytest

from tests.fixtures import small_overrides
from tests.rollout.server_proc import ServerProcess, request
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

    def train(name, world, **extra):
        run_dir, out = tmp_path / f"run-{name}", tmp_path / f"out-{name}"
        argv = ["train", *small_overrides(model_dir, data, run_dir, **{
            "rollout.env": "tests.rollout.agent_envs:AgainEnv", "rollout.agent.max_turns": 3,
            "rollout.max_new_tokens": 60, "rollout.group_size": 2, "rollout.batch_size": 8, "optim.micro_batch_size": 4,
            "rewards": "[{name: digit_parity}]", "train.steps": 3, "train.distributed": "ddp", "optim.lr": 1e-2,
            "train.dist_timeout_s": 60, "train.check_rewards": "false", "train.batch_advice": "false", **extra})]
        torchrun.run(world, torchrun.program("train_parity", out, *argv), timeout=180)
        assert [(out / f"rank{r}.exit").read_text() for r in range(world)] == ["0"] * world
        rows[name] = _rows(run_dir)

    train("2", 2)
    train("1", 1)
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        train("2-server", 2, **{"rollout.engine": "server", "rollout.server": srv.address,
                                "rollout.server_timeout_s": 60})
        assert request(srv.address, "GET", "/version")[1]["version"] == 3          # pushed after each step
    assert [r["step"] for r in rows["2"]] == [1, 2, 3]
    for other in ("1", "2-server"):
        for a, b in zip(rows["2"], rows[other]):
            for k in ("reward/mean", "completion/length_mean", "agent/turns_mean", "agent/obs_token_frac",
                      "agent/stop_max_turns"):
                assert a[k] == pytest.approx(b[k], rel=1e-9), (other, a["step"], k)
            assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-4, abs=1e-6), other
    assert any(r["agent/turns_mean"] > 1 and r["agent/obs_token_frac"] > 0 for r in rows["2"])     # several turns
