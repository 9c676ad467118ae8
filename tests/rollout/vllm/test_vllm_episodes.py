"""Multi-turn episodes on the in-process vLLM engine: the calculator episodes of a tiny model taught
to call the tool (tests/rollout/tool_model.py) are those of the HF engine, greedy and with the same
prompt streams: ids, masks, log-probs and stop reasons. vLLM reads each turn's context as a prompt
(its prefix cache holds the earlier turns)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make test-vllm installs it)")

from grpokit.models import load_model, load_tokenizer  # noqa: E402
from grpokit.rollout.base import PromptStreams, SamplingParams  # noqa: E402
from grpokit.rollout.episodes import EnvSpec, EpisodeRunner, EpisodeSettings  # noqa: E402
from grpokit.rollout.hf import HFEngine  # noqa: E402
from grpokit.rollout.vllm import VLLMEngine  # noqa: E402
from tests.rollout import tool_model  # noqa: E402


def play(engine, tok, temperature):
    runner = EpisodeRunner(engine, tok, EnvSpec(tool_model.Calculator), EpisodeSettings(max_turns=3))
    try:
        return runner.run(tool_model.rows()[:4], SamplingParams(n=2, max_new_tokens=120, temperature=temperature),
                          PromptStreams([21, 22, 23, 24]))
    finally:
        runner.close()


def test_calculator_episodes_on_vllm_are_the_hf_engine_s(tmp_path):
    model_dir = tool_model.build(tmp_path, steps=100, hidden=128)
    tok = load_tokenizer(model_dir)
    hf = HFEngine(load_model(model_dir, dtype="float32", device="cpu"), tok)
    engine = VLLMEngine(str(model_dir), tok, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=128 << 20,
                        enforce_eager=True)
    try:
        assert engine.eos_ids == hf.eos_ids
        for temperature in (0.0, 0.5):
            want, got = play(hf, tok, temperature), play(engine, tok, temperature)
            if temperature == 0:                     # greedy: token for token
                assert torch.equal(want.completion_ids, got.completion_ids)
                assert torch.equal(want.action_mask, got.action_mask)
                assert [e["stop_reason"] for e in want.episodes] == [e["stop_reason"] for e in got.episodes]
                torch.testing.assert_close(want.sampler_logprobs, got.sampler_logprobs, atol=1e-4, rtol=0)
                assert any(e["turns"] > 1 and e["tool_calls"] for e in got.episodes)
            else:                                    # sampled: vLLM's own sampler, the same token layer
                obs = got.completion_mask.bool() & ~got.action_mask.bool()
                assert all(e["stop_reason"] is not None for e in got.episodes)
                for i, e in enumerate(got.episodes):    # every observation token is masked, every turn's trained
                    assert int(got.action_mask[i].sum()) + int(obs[i].sum()) == int(got.completion_mask[i].sum())
    finally:
        engine.close()
