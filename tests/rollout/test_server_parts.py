"""A rollout server's weight updates in parts (buckets) and its per-prompt sampling streams: what a
data-parallel trainer with a server needs (docs/distributed.md, "A rollout server").

The server runs in a thread of the test process (tests/rollout/server_proc.py: the same HTTP and
gloo code as a separate process)."""

from __future__ import annotations

import pytest
import torch

from grpokit.rollout.base import PromptStreams, SamplingParams
from grpokit.rollout.client import RolloutServerError, ServerEngine
from grpokit.rollout.hf import HFEngine
from grpokit.rollout.server import tensor_checksum
from grpokit.models import load_model, load_tokenizer
from tests.fixtures import tiny_run_inputs, varied_trainer
from tests.rollout.server_proc import request, served


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("server_parts"))


def _moved(model, scale: float = 0.01, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's parameters plus seeded noise: weights that differ from the server's in every one
    (a tied LM head is the embedding, named once)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t.detach() + scale * torch.randn(t.shape, generator=g) for n, t in model.named_parameters()}


def test_an_update_in_parts_loads_every_tensor_and_changes_the_version_once(setup):
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    new = _moved(model)
    total = sum(t.numel() * t.element_size() for t in new.values())
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60, bucket_mb=total / 2**20 / 5)   # about 5 parts
        seen = []

        def tensors():                      # the server's version while the parts arrive
            for name, t in new.items():
                seen.append(service.version)
                yield name, t

        engine.update_weights(tensors(), version=3)
        assert set(seen) == {0}                                # not loaded until the last part
        assert service.version == 3 and engine.version == 3
        assert engine.last_sync["sync/parts"] >= 4
        assert engine.last_sync["sync/mb"] == pytest.approx(total / 2**20)
        sums = engine.checksums()
        assert {n: sums[n] for n in new} == {n: tensor_checksum(t) for n, t in new.items()}   # bit for bit
        engine.close()


def test_generation_waits_out_an_update_in_parts_and_an_abandoned_one_is_refused(setup):
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    new = _moved(model)
    names = list(new)
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60)
        first = [(n, new[n]) for n in names[:2]]
        engine._send_part(first, version=1, part=0, last=False)
        engine.http.call("GET", "/version?wait=1")
        gen = {"prompt_ids": [[5, 6, 7]], "params": {"n": 1, "max_new_tokens": 2}}
        status, body, _ = request(address, "POST", "/generate", gen)
        assert status == 503 and "being loaded in parts" in body["error"]
        status, body, _ = request(address, "POST", "/update_weights", {
            "version": 1, "part": 2, "last": True, "tensors": [{"name": names[2], "dtype": "float32",
                                                                 "shape": list(new[names[2]].shape)}]})
        assert status == 409 and "out of order (expected part 1 of version 1)" in body["error"]
        status, body, _ = request(address, "POST", "/update_weights", {
            "version": 1, "part": 1, "last": True, "tensors": [{"name": names[0], "dtype": "float32",
                                                                 "shape": list(new[names[0]].shape)}]})
        assert status == 400 and "repeats a tensor" in body["error"]
        # a whole update supersedes the parts under way
        engine.bucket_bytes = 0
        engine.update_weights(new.items(), version=5)
        status, body, _ = request(address, "POST", "/generate", gen)
        assert status == 200 and body["weights_version"] == 5 and service.partial is None
        engine.bucket_bytes = 512 * 2**20
        engine._send_part(first, version=6, part=0, last=False)
        engine.http.call("GET", "/version?wait=1")
        # the trainer went away between parts: past the deadline the weights are a mix, refused
        service.partial["deadline"] = 0.0
        status, body, _ = request(address, "POST", "/generate", gen)
        assert status == 409 and "arrived in part only" in body["error"]
        engine.update_weights(new.items(), version=2)            # a whole update (in parts) mends it
        assert service.version == 2 and service.broken is None
        status, body, _ = request(address, "POST", "/generate", gen)
        assert status == 200 and body["weights_version"] == 2
        engine.close()


def test_parts_that_leave_out_a_parameter_are_not_loaded_as_a_version(setup):
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    new = _moved(model)
    dropped = next(n for n, _ in model.named_parameters())
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60, bucket_mb=1e-3)
        with pytest.raises(RolloutServerError, match="parameters were in no part"):
            engine.update_weights(((n, t) for n, t in new.items() if n != dropped), version=1)
        assert service.version == 0
        status, body, _ = request(address, "POST", "/generate", {"prompt_ids": [[5]], "params": {"n": 1}})
        assert status == 409 and "mix of two versions" in body["error"]
        engine.close()


def test_per_prompt_streams_sample_on_the_server_as_in_process(setup):
    """stream_seeds: each prompt's completions draw from a stream of their own, so they equal the
    in-process engine's with the same PromptStreams, and do not depend on the rest of the request."""
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    local = HFEngine(model, tok)
    prompts, seeds = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [11, 22, 33]
    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0)
    with served(model_dir) as (address, _, _):
        remote = ServerEngine(address, tok, timeout_s=60)
        a = remote.generate(prompts, params, PromptStreams(seeds))
        b = local.generate(prompts, params, PromptStreams(seeds))
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5, rtol=0)
        alone = remote.generate(prompts[1:2], params, PromptStreams(seeds[1:2]))
        assert torch.equal(alone.completion_ids[:, :alone.completion_ids.shape[1]],
                           a.completion_ids[3:6, :alone.completion_ids.shape[1]])
        status, body, _ = request(address, "POST", "/generate", {"prompt_ids": [[5], [6]], "stream_seeds": [1],
                                                                 "params": {"n": 1}})
        assert status == 400 and "1 stream_seeds for 2 prompts" in body["error"]
        remote.close()


def test_a_client_that_does_not_send_waits_for_the_version_another_pushed(setup):
    """A data-parallel job's other ranks: no weight group; after an update they wait until the
    server holds the version rank 0 pushed (and say so when it does not come)."""
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    with served(model_dir) as (address, service, _):
        sender = ServerEngine(address, tok, timeout_s=60)
        follower = ServerEngine(address, tok, timeout_s=1, sends_weights=False)
        assert follower.group is None
        sender.update_weights(_moved(model).items(), version=1)
        follower.update_weights(iter(()), version=1)
        assert follower.version == 1
        with pytest.raises(RolloutServerError, match="version 2 did not arrive within 1 s"):
            follower.update_weights(iter(()), version=2)
        sender.close()


def test_a_trainer_syncs_a_server_in_parts_every_step(setup):
    """One process, a tiny bucket: every step's push goes in several parts; the server's weights
    equal the trainer's after each step, and the run logs the sync."""
    _, model_dir, _, _ = setup
    with served(model_dir) as (address, service, _):
        tr = varied_trainer(setup, "parts", **{"rollout.engine": "server", "rollout.server": address,
                                               "rollout.server_timeout_s": 60, "rollout.sync_bucket_mb": 0.05})
        exported = dict(tr.worker.export_weights())
        tied = tr.model.config.tie_word_embeddings
        assert tied and "lm_head.weight" in exported                  # the export names the head ...
        params = sum(t.numel() * t.element_size() for n, t in exported.items() if n != "lm_head.weight")
        for _ in range(2):
            m = tr.step()
            tr.step_idx += 1
            assert service.version == tr.step_idx
            assert m["sync/parts"] > 1 and m["time/sync"] > 0
            assert m["sync/mb"] == pytest.approx(params / 2**20)       # ... which is the embedding: not sent
        assert tr.engine.checksums() == {n: tensor_checksum(t) for n, t in tr.worker.export_weights()}
        tr.engine.close()


def test_a_backend_without_parts_asks_for_one_part(setup, monkeypatch):
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    monkeypatch.delattr(HFEngine, "load_part")
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60, bucket_mb=1e-3)
        with pytest.raises(RolloutServerError, match="one part only: set rollout.sync_bucket_mb=0"):
            engine.update_weights(_moved(model).items(), version=1)
        engine.bucket_bytes = 0
        engine.update_weights(_moved(model).items(), version=1)
        assert service.version == 1
        engine.close()

