"""A LoRA run's weight sync to a rollout server: the adapters alone after the base once
(grpokit.rollout.adapters; docs/rollout.md, "LoRA runs send adapters").

The server runs in a thread of the test process (tests/rollout/server_proc.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from grpokit.config import LoraSection
from grpokit.models import load_model, load_tokenizer
from grpokit.models.lora import adapter_update, merged_state_dict, wrap_lora
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.client import RolloutServerError, ServerEngine
from grpokit.rollout.server import tensor_checksum
from tests.fixtures import tiny_run_inputs, varied_trainer
from tests.rollout.server_proc import request, served


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("server_adapters"))


def _lora(model_dir, rank: int = 4, seed: int = 0, **extra):
    model = wrap_lora(load_model(model_dir, dtype="float32", device="cpu"), LoraSection(enabled=True, rank=rank, **extra))
    _shake(model, seed)
    return model


@torch.no_grad()
def _shake(model, seed: int) -> None:
    """Seeded values in every adapter (B starts at 0: the delta would be 0) and in the base weights
    (so a server that kept its own base, not the trainer's, is told apart)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))


def _sums(tensors: dict) -> dict:
    return {n: tensor_checksum(t) for n, t in tensors.items()}


def test_adapters_fold_into_the_base_bit_for_bit_and_cost_a_fraction_of_the_weights(setup):
    _, model_dir, _, _ = setup
    model, tok = _lora(model_dir), load_tokenizer(model_dir)
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60, bucket_mb=0.05)
        assert engine.takes_adapters and engine.needs_base()
        base = merged_state_dict(model, adapters=False)
        ad, specs = adapter_update(model)
        engine.update_adapters(ad, specs, base=iter(base.items()), version=1)
        first = dict(engine.last_sync)
        assert service.version == 1 and service.lora_base and not engine.needs_base()
        server = engine.checksums()
        want = _sums(merged_state_dict(model))
        assert {n: server[n] for n in want} == want                         # base + adapters, bit for bit

        for step in (2, 3):          # new adapters alone, twice: each lands on the base, not on the last merge
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
            ad, specs = adapter_update(model)
            engine.update_adapters(ad, specs, version=step)
            server, want = engine.checksums(), _sums(merged_state_dict(model))
            assert {n: server[n] for n in want} == want
        adapter_bytes = sum(t.numel() * t.element_size() for _, t in ad)
        assert engine.last_sync["sync/parts"] == 1
        assert engine.last_sync["sync/mb"] == pytest.approx(adapter_bytes / 2**20)
        assert first["sync/parts"] > 2 and first["sync/mb"] > 5 * engine.last_sync["sync/mb"]
        engine.close()


def test_adapters_alone_need_the_base_and_a_full_update_forgets_it(setup):
    _, model_dir, _, _ = setup
    model, tok = _lora(model_dir), load_tokenizer(model_dir)
    ad, specs = adapter_update(model)
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60)
        engine.base_sent = True                                   # pretend: the server has no base yet
        with pytest.raises(RolloutServerError, match="adapters alone need the base weights first"):
            engine.update_adapters(ad, specs, version=1)
        assert service.version == 0
        engine.update_adapters(ad, specs, base=iter(merged_state_dict(model, adapters=False).items()), version=1)
        engine.update_weights(merged_state_dict(model).items(), version=2)     # merged: the server has no base now
        assert not service.lora_base and engine.needs_base()
        engine.base_sent = True
        with pytest.raises(RolloutServerError, match="need the base weights first"):
            engine.update_adapters(ad, specs, version=3)
        engine.close()


def test_malformed_adapter_updates_are_refused_before_anything_moves(setup):
    _, model_dir, _, _ = setup
    model, tok = _lora(model_dir), load_tokenizer(model_dir)
    ad, specs = adapter_update(model)
    layer = next(iter(specs))
    meta = lambda name, shape: {"name": name, "dtype": "float32", "shape": list(shape)}   # noqa: E731
    shapes = {n: list(t.shape) for n, t in ad}
    with served(model_dir) as (address, service, _):
        ServerEngine(address, tok, timeout_s=60)               # joins the weight group
        cases = [
            ({layer: specs[layer]}, [meta(f"{layer}.lora_A", shapes[f"{layer}.lora_A"])], "'.*lora_B' is missing"),
            ({layer: specs[layer]}, [meta(f"{layer}.lora_A", shapes[f"{layer}.lora_A"]),
                                     meta(f"{layer}.lora_B", [shapes[f"{layer}.lora_B"][0] + 1, shapes[f"{layer}.lora_B"][1]])],
             "do not fit its weight"),
            ({"model.nowhere": specs[layer]}, [meta("model.nowhere.lora_A", [4, 8]), meta("model.nowhere.lora_B", [8, 4])],
             "no linear layer 'model.nowhere'"),
        ]
        for adapters, tensors, why in cases:
            status, body, _ = request(address, "POST", "/update_weights",
                                      {"version": 1, "tensors": tensors, "adapters": adapters})
            assert status == 400, body
            assert re.search(why, body["error"]), body["error"]
        status, body, _ = request(address, "POST", "/update_weights", {
            "version": 1, "tensors": [meta(n, s) for n, s in shapes.items()], "adapters": specs, "part": 0, "last": False})
        assert status == 400 and "as a whole update or as the last part" in body["error"]
        status, body, _ = request(address, "POST", "/update_weights", {
            "version": 1, "tensors": [meta(n, s) for n, s in shapes.items()],
            "adapters": {**specs, layer: {**specs[layer], "scale": float("inf")}}})
        assert status == 400
        assert service.version == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_equals_peft_s_merge_for_linear_and_conv1d_layers(dtype):
    """A linear layer and a GPT-2 style Conv1D (its weight stored transposed: peft's
    fan_in_fan_out), in float32 and bfloat16 (peft's half-precision CPU path goes through float32):
    the server's fold of `adapter_update` gives peft's own merge (`merged_state_dict`), bit for bit."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    from grpokit.rollout.adapters import AdapterMerger

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.conv = torch.nn.Linear(6, 5), Conv1D(5, 6)

    torch.manual_seed(0)
    model = get_peft_model(Two().to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules=["lin", "conv"]),
                           autocast_adapter_dtype=False)                 # adapters in the model's dtype
    _shake(model, seed=1)
    ad, specs = adapter_update(model)
    assert specs["conv"]["fan_in_fan_out"] and specs["lin"]["fp32"] == (dtype == torch.bfloat16)
    state = merged_state_dict(model, adapters=False)
    AdapterMerger().apply(state, dict(ad), specs)
    want = merged_state_dict(model)
    for name in ("lin.weight", "conv.weight"):
        assert torch.equal(state[name], want[name]), name
        assert not torch.equal(state[name], merged_state_dict(model, adapters=False)[name])


@pytest.mark.parametrize("adapters", [True, False])
def test_a_lora_run_with_a_server_sends_adapters_and_the_server_follows(setup, adapters):
    root, model_dir, _, _ = setup
    with served(model_dir) as (address, service, _):
        tr = varied_trainer(setup, f"lora_server_{adapters}", **{
            "lora.enabled": True, "lora.rank": 4, "rollout.engine": "server", "rollout.server": address,
            "rollout.sync_adapters": adapters, "train.steps": 3})
        tr.train()
        rows = [json.loads(line) for line in (root / f"lora_server_{adapters}" / "metrics.jsonl").open()]
        mb = [r["sync/mb"] for r in rows]
        full = sum(t.numel() * t.element_size() for t in merged_state_dict(tr.worker.model).values()) / 2**20
        ad, _ = adapter_update(tr.worker.model)
        small = sum(t.numel() * t.element_size() for _, t in ad) / 2**20
        assert mb == pytest.approx([small if adapters else full] * 3)
        assert service.version == 3 and service.lora_base == adapters
        server, want = tr.engine.checksums(), _sums(merged_state_dict(tr.worker.model))
        assert {n: server[n] for n in want} == want
        tr.engine.close()


def test_a_pool_sends_the_base_only_to_the_server_that_lacks_it(setup):
    """Two servers take a LoRA run's adapters; B stops and starts again (a new instance, base
    weights of its own): before the next update the pool takes it back and sends it the base, A the
    adapters alone, and both end up holding the trainer's merged weights."""
    import contextlib

    from grpokit.rollout.servers import ServerPool

    _, model_dir, _, _ = setup
    model, tok = _lora(model_dir), load_tokenizer(model_dir)
    base = lambda: iter(merged_state_dict(model, adapters=False).items())   # noqa: E731
    with contextlib.ExitStack() as stack:
        a, svc_a, _ = stack.enter_context(served(model_dir))
        b_ctx = served(model_dir)
        b, _, _ = b_ctx.__enter__()
        port_b = int(b.rsplit(":", 1)[1])
        pool = ServerPool([a, b], tok, timeout_s=30, retries=1)
        assert pool.takes_adapters and pool.needs_base()
        pool.update_adapters(*adapter_update(model), base=base(), version=1)
        assert not pool.needs_base()
        b_ctx.__exit__(None, None, None)
        _shake(model, seed=1)       # the base moves too: B must get the trainer's, A keeps the one it had
        pool.generate([[5, 6], [7, 8]], SamplingParams(n=1, max_new_tokens=2), torch.Generator().manual_seed(0))
        assert pool.live() == [a]                                # B dropped, its prompts drawn on A
        b, svc_b, _ = stack.enter_context(served(model_dir, port=port_b))
        assert pool.needs_base()                                 # B is back, without the base
        pool.update_adapters(*adapter_update(model), base=base(), version=2)
        assert svc_a.version == svc_b.version == 2 and pool.last_sync["rollout/servers"] == 2
        merged_a = _sums(merged_state_dict(model))
        sums_b = pool.clients[b].checksums()
        assert {n: sums_b[n] for n in merged_a} == merged_a     # B: the new base + adapters
        sums_a = pool.clients[a].checksums()
        assert sums_a != sums_b                                  # A folded the adapters into its first base
        pool.close()


def test_a_4bit_base_goes_dequantized_and_its_adapters_fold_in_bit_for_bit(setup):
    """QLoRA: the server holds full-precision weights, so the trainer sends its base dequantized
    (the weights its 4-bit layers compute with), and the adapters after it; the server's weights
    then equal the trainer's merged export (dequantized base + scale B A) bit for bit."""
    from grpokit.models.lora import four_bit_unavailable, load_4bit_model

    if (why := four_bit_unavailable("cpu")) is not None:
        pytest.skip(why)
    _, model_dir, _, _ = setup
    lcfg = LoraSection(enabled=True, rank=4, load_in_4bit=True)
    model = wrap_lora(load_4bit_model(model_dir, lcfg, dtype="float32", device="cpu"), lcfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    tok = load_tokenizer(model_dir)
    with served(model_dir) as (address, service, _):
        engine = ServerEngine(address, tok, timeout_s=60)
        engine.update_adapters(*adapter_update(model), base=iter(merged_state_dict(model, adapters=False).items()),
                               version=1)
        server, want = engine.checksums(), _sums(merged_state_dict(model))
        assert {n: server[n] for n in want} == want
        plain = load_model(model_dir, dtype="float32", device="cpu").state_dict()
        layer = next(n for n in want if n.endswith("q_proj.weight"))
        assert server[layer] != tensor_checksum(plain[layer])        # not the file's weights: the 4-bit ones
        engine.close()
