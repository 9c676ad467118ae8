"""Agent loops the user owns (grpokit.rollout.episodes.custom): generate calls batched across
episodes, the returned masks and log-probs checked against what the engine sampled, failures and
hangs contained, segments trained one row each with the episode's advantage."""

from __future__ import annotations

import json
import time

import pytest
import torch

from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.episodes import LoopRunner, Trajectory
from grpokit.tasks.tiny import build_chat_tokenizer, build_tiny_model, save_pretrained
from grpokit.train import build_run
from grpokit.train.batch import from_rollout, to_segments
from tests.fixtures import small_overrides
from tests.rollout.agent_envs import two_turn_loop
from tests.rollout.test_episodes import CHARS, ScriptedEngine, said

ROWS = [{"prompt": "What is 12*3?", "answer": 36}, {"prompt": "What is 7*8?", "answer": 56}]


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer(CHARS)


def header(tok) -> list[int]:
    """A prompt ending in the assistant header (the scripted engine's turn 0)."""
    return tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def engine_for(tok):
    # turn t of every episode: a short answer whose tokens say which turn it is
    return ScriptedEngine(tok, lambda t, k: said(tok, f"turn {t}"))


def test_generate_calls_are_batched_and_the_trajectory_is_kept_as_returned(tok):
    engine = engine_for(tok)
    out = LoopRunner(engine, tok, two_turn_loop).run(ROWS, SamplingParams(n=3, max_new_tokens=100))
    assert len(out) == 6
    # two rounds of generate, each one engine call holding all six episodes' requests
    assert [len(c[0]) for c in engine.calls] == [6, 6]
    t0, t1 = said(tok, "turn 0"), said(tok, "turn 1")
    for i in range(6):
        n = int(out.completion_mask[i].sum())
        ids, act = out.completion_ids[i, :n].tolist(), out.action_mask[i, :n].tolist()
        assert [t for t, a in zip(ids, act) if a] == t0 + t1
        assert ids[:len(t0)] == t0 and ids[-len(t1):] == t1 and 0 in act
        lp = out.sampler_logprobs[i, :n]
        assert torch.allclose(lp[torch.tensor(act).bool()], torch.tensor([-0.01] * len(t0) + [-0.02] * len(t1)))
        assert float(lp[~torch.tensor(act).bool()].abs().sum()) == 0.0
        rec = out.episodes[i]
        assert rec["stop_reason"] == "stop" and rec["turns"] == 2 and rec["tool_calls"] == 1
        assert rec["final"] == "turn 1" and rec["env_reward"] == float(sum(t0) % 3)


def test_trained_tokens_the_engine_did_not_sample_are_refused(tok):
    p = header(tok)

    def leaky(engine, row):
        out = engine.generate(p)
        obs = [9, 9, 9]
        return Trajectory(prompt_ids=p, ids=out.ids + obs, mask=[1] * (len(out.ids) + 3),
                          logprobs=out.logprobs + [0.0] * 3)

    with pytest.raises(ConfigError, match="mask 0") as err:
        LoopRunner(engine_for(tok), tok, leaky).run(ROWS[:1], SamplingParams(n=2, max_new_tokens=50))
    assert "\n" not in str(err.value)

    def wrong_logprobs(engine, row):
        out = engine.generate(p)
        return Trajectory(prompt_ids=p, ids=out.ids, mask=[1] * len(out.ids), logprobs=[0.0] * len(out.ids))

    with pytest.raises(ConfigError, match="log-probs"):
        LoopRunner(engine_for(tok), tok, wrong_logprobs).run(ROWS[:1], SamplingParams(n=2, max_new_tokens=50))
    with pytest.raises(ConfigError, match="must return a Trajectory"):
        LoopRunner(engine_for(tok), tok, lambda e, r: {"ids": []}).run(ROWS[:1], SamplingParams(n=2, max_new_tokens=50))


def test_a_failing_or_hanging_episode_is_recorded_and_the_others_go_on(tok, caplog):
    def flaky(engine, row):
        if engine._index == 1:
            raise RuntimeError("the browser crashed")
        if engine._index == 2:
            time.sleep(30)                     # never asks again within the wait
        return two_turn_loop(engine, row)

    t = time.monotonic()
    with caplog.at_level("WARNING", logger="grpokit.rollout"):
        out = LoopRunner(engine_for(tok), tok, flaky, wait_s=1.0).run(ROWS, SamplingParams(n=2, max_new_tokens=100))
    assert time.monotonic() - t < 20
    stops = [r["stop_reason"] for r in out.episodes]
    assert stops == ["stop", "tool_error", "timeout", "stop"]
    assert "browser crashed" in caplog.text
    assert int(out.completion_mask[1].sum()) == 0 and int(out.action_mask[3].sum()) > 0
    with pytest.raises(ConfigError, match="every episode failed"):
        LoopRunner(engine_for(tok), tok, lambda e, r: 1 / 0).run(ROWS, SamplingParams(n=2, max_new_tokens=10))


def test_the_token_budget_covers_all_of_an_episode_s_generate_calls(tok):
    seen, p = [], header(tok)

    def greedy(engine, row):
        outs = [engine.generate(p, max_new_tokens=100) for _ in range(5)]
        seen.append([len(o.ids) for o in outs])
        ids = [t for o in outs for t in o.ids]
        return Trajectory(prompt_ids=p, ids=ids, mask=[1] * len(ids), logprobs=[x for o in outs for x in o.logprobs])

    out = LoopRunner(engine_for(tok), tok, greedy).run(ROWS[:1], SamplingParams(n=2, max_new_tokens=15))
    per_turn = len(said(tok, "turn 0"))
    assert all(sum(s) == 15 for s in seen) and seen[0][0] == per_turn and seen[0][-1] == 0
    assert [r["stop_reason"] for r in out.episodes] == ["length", "length"]


def test_segments_become_one_row_each_with_their_own_prompt_and_mask(tok):
    p = header(tok)

    def segmented(engine, row):
        a = engine.generate(p)
        b = engine.generate([8] + p)                        # a rewritten history
        return [Trajectory(p, a.ids, [1] * len(a.ids), a.logprobs),
                Trajectory([8] + p, [4] + b.ids, [0] + [1] * len(b.ids), [0.0] + b.logprobs)]

    rb = LoopRunner(engine_for(tok), tok, segmented).run(ROWS, SamplingParams(n=2, max_new_tokens=100))
    batch = from_rollout(rb, [0, 1], ROWS, 2)
    batch.loss_mask[1] = 0                                  # a transform dropped episode 1
    seg = to_segments(batch, pad_id=0)
    assert len(seg) == 8 and seg.episode_of.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert seg.prompt_ids[0] == p and seg.prompt_ids[1] == [8] + p
    n1 = int(seg.mask[1].sum())
    assert seg.completion_ids[1, 0] == 4 and seg.action_mask[1, :n1].tolist() == [0] + [1] * (n1 - 1)
    assert seg.loss_mask[1, 0] == 0 and seg.loss_mask[1, 1:n1].all()
    assert not seg.loss_mask[2].any() and not seg.loss_mask[3].any()
    assert seg.finish_reason[1] == batch.finish_reason[0]


def test_a_loop_from_the_config_trains(tmp_path):
    tok = build_chat_tokenizer(CHARS)
    model_dir = save_pretrained(build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64,
                                                 max_positions=512), tok, tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 2))
    cfg = load_config(None, small_overrides(model_dir, data, tmp_path / "run", **{
        "rollout.group_size": 2, "rollout.batch_size": 4, "rollout.max_new_tokens": 40, "optim.micro_batch_size": 4,
        "rewards": "[{name: env}]", "train.steps": 1, "rollout.agent.loop": "tests.rollout.agent_envs:two_turn_loop"}))
    torch.manual_seed(0)
    tr = build_run(cfg, health=False, report=False)
    before = {n: p.detach().clone() for n, p in tr.worker.model.named_parameters()}
    m = tr.step()
    b = tr.last_batch
    obs = (b.mask == 1) & (b.action_mask == 0)
    assert obs.any() and not (b.loss_mask.bool() & obs).any()
    assert m["agent/turns_mean"] == 2 and m["agent/tool_calls"] == 4
    assert b.rewards.std() > 0 and b.advantages.abs().sum() > 0
    assert any(not torch.equal(before[n], p) for n, p in tr.worker.model.named_parameters())
    with pytest.raises(Exception, match="not both"):
        load_config(None, small_overrides(model_dir, data, tmp_path / "bad", **{
            "rollout.agent.loop": "tests.rollout.agent_envs:two_turn_loop",
            "rollout.env": "tests.rollout.agent_envs:CalcEnv"}))


def test_the_api_takes_a_loop_function(tmp_path):
    from grpokit import GRPO

    tok = build_chat_tokenizer(CHARS)
    model_dir = save_pretrained(build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64,
                                                 max_positions=512), tok, tmp_path / "model")
    rows = ROWS * 2
    calls = []

    def my_loop(engine, row):
        calls.append(row["answer"])
        return two_turn_loop(engine, row)

    torch.manual_seed(0)
    grpo = GRPO(model=str(model_dir), rewards=["env"], dataset=rows, agent_loop=my_loop, overrides={
        "rollout.group_size": 2, "rollout.batch_size": 4, "rollout.max_new_tokens": 40, "optim.micro_batch_size": 4,
        "train.steps": 1, "train.run_dir": str(tmp_path / "run"), "train.save_every": 0, "monitor.sinks": ["jsonl"]})
    assert grpo.config.rollout.agent.loop.endswith("my_loop")
    grpo.train()
    assert len(calls) == 4 and set(map(str, calls)) <= {"36", "56"}
    with pytest.raises(ConfigError, match="not both"):
        GRPO(model=str(model_dir), rewards=["env"], dataset=rows, agent_loop=my_loop, tools=[len])


def test_an_engine_failure_reaches_the_caller_and_frees_the_episodes(tok):
    class Failing:
        def generate(self, prompt_ids, params, generator=None):
            raise RuntimeError("non-finite logits")

    seen = []

    def loop(engine, row):
        try:
            return two_turn_loop(engine, row)
        finally:
            seen.append(row["answer"])

    with pytest.raises(RuntimeError, match="non-finite"):
        LoopRunner(Failing(), tok, loop).run(ROWS, SamplingParams(n=2, max_new_tokens=20))
    deadline = time.monotonic() + 10
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(seen) == 4                      # every episode's thread returned, none left waiting
