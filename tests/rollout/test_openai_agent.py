"""Agent code written against the real `openai` package trains unchanged through the
OpenAI-compatible endpoint (grpokit.rollout.episodes.gateway): its calls record exactly what the
engine sampled, consecutive calls merge into one sequence when their ids continue, and a call
without an episode id the trainer handed out is refused."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai", reason="the openai package is a test dependency (make setup installs it)")
pytest.importorskip("fastapi", reason="fastapi is needed for the endpoint (grpokit[agents])")

from grpokit.config import load_config  # noqa: E402
from grpokit.errors import ConfigError  # noqa: E402
from grpokit.models import load_model, load_tokenizer  # noqa: E402
from grpokit.rollout.base import SamplingParams  # noqa: E402
from grpokit.rollout.episodes import EnvSpec, EpisodeRunner, EpisodeSettings, LoopRunner  # noqa: E402
from grpokit.rollout.episodes.gateway import Gateway, OpenAIAgent  # noqa: E402
from grpokit.rollout.hf import HFEngine  # noqa: E402
from grpokit.train import build_run  # noqa: E402
from tests.fixtures import small_overrides  # noqa: E402
from tests.rollout import tool_model  # noqa: E402
from tests.rollout.openai_agents import calculator_agent  # noqa: E402


def test_openai_agent_episodes_are_the_environment_s_token_for_token(tool_model_dir):
    """The same calculator protocol, once as an environment and once as OpenAI-API agent code:
    greedy, the episodes' ids, masks and sampler log-probs are equal (one sequence per episode:
    each call's prompt continues the previous call's ids exactly). One episode per row, so that
    both send the engine the same batches (the same padding: the same float rounding)."""
    tok = load_tokenizer(tool_model_dir)
    engine = HFEngine(load_model(tool_model_dir, dtype="float32", device="cpu"), tok)
    params = SamplingParams(n=1, max_new_tokens=400, temperature=0.0)   # a budget neither reaches (they count
                                                                         # observations differently)
    rows = tool_model.rows()
    env_runner = EpisodeRunner(engine, tok, EnvSpec(tool_model.Calculator), EpisodeSettings(max_turns=3))
    want = env_runner.run(rows, params, torch.Generator().manual_seed(0))
    agent = LoopRunner(engine, tok, OpenAIAgent(calculator_agent, tok, engine.eos_ids), wait_s=60)
    try:
        got = agent.run(rows, params, torch.Generator().manual_seed(0))
    finally:
        agent.close()
    assert any(e["tool_calls"] for e in got.episodes) and any(e["turns"] > 1 for e in got.episodes)
    assert all("segments" not in e for e in got.episodes)          # merged: one sequence each
    assert torch.equal(want.completion_ids, got.completion_ids)
    assert torch.equal(want.action_mask, got.action_mask)
    torch.testing.assert_close(want.sampler_logprobs, got.sampler_logprobs, atol=1e-6, rtol=0)
    assert [e["tool_calls"] for e in want.episodes] == [e["tool_calls"] for e in got.episodes]


def test_a_run_trains_openai_agent_code_and_a_call_without_an_episode_is_refused(tool_model_dir, tmp_path):
    data = tool_model_dir.parent / "train.jsonl"
    cfg = load_config(None, small_overrides(tool_model_dir, data, tmp_path / "run", **{
        "rollout.agent": "tests.rollout.openai_agents:calculator_agent", "rollout.max_new_tokens": 200,
        "rollout.group_size": 2, "rollout.batch_size": 4, "optim.micro_batch_size": 4, "train.steps": 2,
        "rollout.temperature": 0.5, "optim.lr": 1e-3, "rewards": "[{name: math_accuracy}]",
        "train.batch_advice": "false"}))
    assert cfg.rollout.agent.openai == "tests.rollout.openai_agents:calculator_agent"
    torch.manual_seed(0)
    tr = build_run(cfg, health=False, report=False)
    before = {n: p.detach().clone() for n, p in tr.worker.model.named_parameters()}
    agent = tr.collector.episodes.fn
    tr.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["agent/tool_calls"] > 0 for r in rows)
    assert any(not torch.equal(before[n], p) for n, p in tr.worker.model.named_parameters())
    assert agent.gateway is None                                   # the endpoint stopped with the run


def test_a_call_without_a_known_episode_id_is_refused_with_one_line(tool_model_dir):
    tok = load_tokenizer(tool_model_dir)
    gateway = Gateway(tok, [tok.eos_token_id])
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="grpokit-policy", messages=[{"role": "user", "content": "hi"}])
        message = err.value.body["message"]
        assert "unknown episode id" in message and "\n" not in message
        with pytest.raises(openai.BadRequestError, match="unknown episode id 'nope'"):
            client.chat.completions.create(model="grpokit-policy", messages=[{"role": "user", "content": "hi"}],
                                           user="nope")
    finally:
        gateway.shutdown()


def test_agent_code_that_is_not_async_or_given_with_an_environment_is_refused(tool_model_dir):
    tok = load_tokenizer(tool_model_dir)
    with pytest.raises(ConfigError, match="must be an async function"):
        OpenAIAgent(lambda client, row: None, tok, [tok.eos_token_id])
    with pytest.raises(ConfigError, match="give it alone"):
        load_config(None, small_overrides(tool_model_dir, tool_model_dir.parent / "train.jsonl", "/tmp/x", **{
            "rollout.agent.openai": "tests.rollout.openai_agents:calculator_agent",
            "rollout.env": "tests.rollout.tool_model:Calculator"}))
