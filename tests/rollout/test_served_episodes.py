"""Multi-turn episodes on a rollout server (HF backend): each turn is a /generate request with the
episode's ids so far, so the ids, masks, sampler log-probs and stop reasons are those of the
in-process engine on the same model, greedy and seeded alike; and a run trains on them."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from grpokit.config import load_config
from grpokit.models import load_model, load_tokenizer
from grpokit.rollout.base import PromptStreams, SamplingParams
from grpokit.rollout.client import ServerEngine
from grpokit.rollout.episodes import EnvSpec, EpisodeRunner, EpisodeSettings
from grpokit.rollout.hf import HFEngine
from grpokit.train import build_run
from tests.fixtures import small_overrides
from tests.rollout import tool_model
from tests.rollout.server_proc import served


@pytest.fixture(scope="module")
def model_dir(tool_model_dir):
    return tool_model_dir


def play(engine, tok, params, generator, rows=None):
    runner = EpisodeRunner(engine, tok, EnvSpec(tool_model.Calculator), EpisodeSettings(max_turns=3))
    try:
        return runner.run(rows or tool_model.rows()[:4], params, generator)
    finally:
        runner.close()


def same_episodes(a, b):
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.action_mask, b.action_mask) and torch.equal(a.completion_mask, b.completion_mask)
    assert torch.allclose(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5)
    assert [e["stop_reason"] for e in a.episodes] == [e["stop_reason"] for e in b.episodes]
    assert [e["messages"] for e in a.episodes] == [e["messages"] for e in b.episodes]


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_episodes_on_a_server_are_the_in_process_engine_s(model_dir, temperature):
    tok = load_tokenizer(model_dir)
    local = HFEngine(load_model(model_dir, dtype="float32", device="cpu"), tok)
    params = SamplingParams(n=2, max_new_tokens=120, temperature=temperature)
    seeds = [11, 12, 13, 14]
    want = play(local, tok, params, PromptStreams(seeds))
    with served(model_dir) as (address, _, _):
        engine = ServerEngine(address, tok, sends_weights=False)
        assert engine.eos_ids == local.eos_ids
        got = play(engine, tok, params, PromptStreams(seeds))
    same_episodes(want, got)
    assert any(e["turns"] > 1 and e["tool_calls"] for e in got.episodes)          # tool calls and observations
    assert (got.completion_mask.bool() & ~got.action_mask.bool()).any()
    if temperature == 0:                                  # greedy: the taught call and the tool's answer
        assert any(e["stop_reason"] == "stop" and e["turns"] == 2 for e in got.episodes)


def test_an_episode_samples_the_same_whichever_episodes_share_its_batch(model_dir):
    """With prompt streams (a data-parallel job's groups) each episode's turns draw from streams of
    its own: played with other rows, or alone, its ids are the same."""
    tok = load_tokenizer(model_dir)
    engine = HFEngine(load_model(model_dir, dtype="float32", device="cpu"), tok)
    params = SamplingParams(n=2, max_new_tokens=120, temperature=1.0)
    rows = tool_model.rows()[:3]
    together = play(engine, tok, params, PromptStreams([5, 6, 7]), rows)
    alone = play(engine, tok, params, PromptStreams([6]), rows[1:2])
    for k in range(2):
        n = int(alone.completion_mask[k].sum())
        assert together.completion_ids[2 + k, :n].tolist() == alone.completion_ids[k, :n].tolist()
        assert together.action_mask[2 + k, :n].tolist() == alone.action_mask[k, :n].tolist()


class UnevenCalculator(tool_model.Calculator):
    """The calculator with a random delay per call (0 to 0.3 s): episodes' tools answer in an
    order that changes from run to run."""

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: digits and + - *, e.g. 12*3
        """
        time.sleep(random.random() * 0.3)
        return super().calculator(expression)


def test_per_episode_scheduling_samples_what_batched_turns_sample(model_dir):
    """With per-episode scheduling the engine calls group episodes by when their tools answered,
    which changes from run to run; each episode's turns still draw from streams of its own, so it
    samples what batched turns sample, and a run's seed alone fixes the episodes."""
    tok = load_tokenizer(model_dir)
    engine = HFEngine(load_model(model_dir, dtype="float32", device="cpu"), tok)
    params = SamplingParams(n=2, max_new_tokens=120, temperature=0.5)
    rows = tool_model.rows()[:4]

    def play_with(mode, generator):
        runner = EpisodeRunner(engine, tok, EnvSpec(UnevenCalculator), EpisodeSettings(max_turns=3, scheduling=mode))
        return runner.run(rows, params, generator)

    batched = play_with("batched", PromptStreams([11, 12, 13, 14]))
    per = play_with("per_episode", PromptStreams([11, 12, 13, 14]))
    same_episodes(batched, per)
    assert any(e["tool_calls"] for e in per.episodes)
    seeded = [play_with("per_episode", torch.Generator().manual_seed(3)) for _ in range(2)]
    same_episodes(*seeded)


def test_a_run_trains_on_episodes_played_by_a_server(model_dir, tmp_path):
    data = model_dir.parent / "train.jsonl"
    with served(model_dir) as (address, service, _):
        cfg = load_config(None, small_overrides(model_dir, data, tmp_path / "run", **{
            "rollout.engine": "server", "rollout.server": address, "rollout.env": "tests.rollout.tool_model:Calculator",
            "rollout.agent.max_turns": 3, "rollout.max_new_tokens": 200, "rollout.group_size": 2,
            "rollout.batch_size": 4, "optim.micro_batch_size": 4, "train.steps": 2, "optim.lr": 1e-3,
            "rollout.temperature": 0.5, "train.batch_advice": "false",
            "rewards": "[{name: math_accuracy}]"}))
        torch.manual_seed(0)
        trainer = build_run(cfg, health=False, report=False)
        trainer.train()
        assert service.version == 2                       # pushed after each step
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["agent/turns_mean"] > 1 and r["agent/obs_token_frac"] > 0 for r in rows), \
        [(r["agent/turns_mean"], r["agent/obs_token_frac"]) for r in rows]         # observations came back
    assert all(r["rollout/staleness"] == 0 for r in rows)
    assert trainer.last_batch.episodes is not None


def _async_trainer(model_dir, run_dir, address, **extra):
    cfg = load_config(None, small_overrides(model_dir, model_dir.parent / "train.jsonl", run_dir, **{
        "rollout.engine": "server", "rollout.server": address, "rollout.server_timeout_s": 60,
        "rollout.env": "tests.rollout.tool_model:Calculator", "rollout.agent.max_turns": 3,
        "rollout.max_new_tokens": 200, "rollout.group_size": 2, "rollout.batch_size": 4, "optim.micro_batch_size": 4,
        "rollout.temperature": 0.5, "train.steps": 4, "optim.lr": 1e-2, "rewards": "[{name: test_varied}]",
        "train.batch_advice": "false", "rollout.async": True, **extra}))
    torch.manual_seed(0)
    return build_run(cfg, health=False, report=False)


def _record(tr, stop_after=None):
    out = []

    def progress(step, metrics):
        out.append({"idx": tr.last_batch.prompt_index.tolist(),
                    "ids": tr.last_batch.completion_ids.tolist(), **metrics})
        if step == stop_after:
            raise KeyboardInterrupt              # a crash right after the step's checkpoint

    try:
        tr.train(progress=progress)
    except KeyboardInterrupt:
        pass
    tr.engine.close()
    return out


def test_async_episodes_are_one_step_stale_and_a_resume_plays_the_ones_in_flight_again(model_dir, tmp_path):
    """`rollout.async` with episodes: the next batch's episodes play on a thread while the step
    trains, every turn on the weights they began with (the push waits for them); a checkpoint keeps
    the prompts and seed in flight, and a resumed run plays those episodes again with its weights."""
    with served(model_dir) as (address, _, _):
        whole = _record(_async_trainer(model_dir, tmp_path / "whole", address))
        cut = _record(_async_trainer(model_dir, tmp_path / "cut", address, **{"train.save_every": 2}), stop_after=2)
        resumed_tr = _async_trainer(model_dir, tmp_path / "cut", address, **{"train.save_every": 2})
        resumed = []
        resumed_tr.train(resume=True, progress=lambda step, m: resumed.append(
            {"idx": resumed_tr.last_batch.prompt_index.tolist(), **m}))
        resumed_tr.engine.close()
    assert [m["rollout/staleness"] for m in whole] == [0.0, 1.0, 1.0, 1.0]
    assert all("time/rollout_wait" in m for m in whole)                          # the push waited for them
    assert all(m["rollout/logprob_diff_mean"] > 1e-4 for m in whole[1:])      # the weights moved under them
    assert any(m["agent/turns_mean"] > 1 for m in whole)
    assert [m["idx"] for m in cut + resumed] == [m["idx"] for m in whole]
    assert cut[1]["ids"] == whole[1]["ids"]                                       # the same run up to the cut
    assert [m["rollout/staleness"] for m in resumed] == [0.0, 1.0]
