"""Rollout engines by name: `rollout.engine` in config names a factory registered here.

A factory is called as `factory(model, tokenizer, **options)` and returns a
`grpokit.rollout.base.RolloutEngine`; the trainer passes `rollout=` (the config's `rollout`
section) among the options, for engines with settings of their own (`server`). Register your own with `register_engine("name", factory)`
before the config is validated. This module imports nothing heavy: a factory imports its engine
when it is called.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

from grpokit._names import lookup, register

__all__ = ["ENGINES", "EngineFactory", "build_engine", "get_engine", "register_engine"]

EngineFactory = Callable[..., Any]
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory | None = None, *, overwrite: bool = False):
    """Register `factory(model, tokenizer, **options) -> engine` under `name` (also a decorator)."""
    return register(ENGINES, name, factory, what="rollout engine", overwrite=overwrite)


def get_engine(name: str) -> EngineFactory:
    """The factory registered as `name`; ValueError naming the closest registered name."""
    return lookup(ENGINES, name, "rollout engine", listing="registered")


def build_engine(name: str, model, tokenizer, **options):
    """The engine `name` over `model` (the policy). The trainer passes `rollout=` (its
    `RolloutConfig`): factories read their own sub-section (`rollout.vllm`, `rollout.server`) from it."""
    return get_engine(name)(model, tokenizer, **options)


@register_engine("hf")
def _hf(model, tokenizer, **options):
    """In-process generation with the transformers model itself (`grpokit.rollout.hf.HFEngine`):
    no weight sync, the sampler is the trainer."""
    from grpokit.rollout.hf import HFEngine

    return HFEngine(model, tokenizer)


@register_engine("hf_copy")
def _hf_copy(model, tokenizer, **options):
    """In-process generation over the engine's own frozen copy of the weights, refreshed from the
    trainer after every optimizer step: the decoupled-engine path (weight sync, pi_old recomputed,
    importance correction) without another process. A LoRA policy's copy is a plain model holding
    the merged weights."""
    from grpokit.rollout.hf import HFEngine

    if hasattr(model, "get_base_model"):            # PEFT: a plain model of the base's architecture
        from grpokit.models.lora import merged_copy
        own = merged_copy(model)
    else:
        own = copy.deepcopy(model)
    own.eval()
    for p in own.parameters():
        p.requires_grad_(False)
    return HFEngine(own, tokenizer, owns_weights=True)


@register_engine("server")
def _server(model, tokenizer, rollout=None, sends_weights: bool = True, push: bool = True, **options):
    """Generation in a `grpokit rollout-server` process at `rollout.server` (HOST:PORT,
    `grpokit.rollout.client.ServerEngine`), or in several (a list: `grpokit.rollout.servers.ServerPool`);
    weights pushed over a torch.distributed group each. The
    server starts from the policy's weights as they are now (version 0; LoRA merged), unless `push`
    is False (a data-parallel trainer pushes them from its workers, every rank taking part).
    `sends_weights`: False for the clients of a data-parallel job's other ranks."""
    from grpokit.errors import ConfigError
    from grpokit.rollout.client import ServerEngine
    from grpokit.models.lora import adapter_update, is_peft, merged_state_dict

    if rollout is None or not rollout.server:
        raise ConfigError("rollout.engine=server needs rollout.server=HOST:PORT (a running `grpokit rollout-server`)")
    options = dict(device=next(model.parameters()).device, timeout_s=rollout.server_timeout_s,
                   retries=rollout.server_retries, api_key=os.environ.get(rollout.server_api_key_env) or None,
                   sends_weights=sends_weights, bucket_mb=rollout.sync_bucket_mb, adapters=rollout.sync_adapters)
    addresses = rollout.server if isinstance(rollout.server, list) else [rollout.server]
    if len(addresses) > 1:                          # several servers: grpokit.rollout.servers
        from grpokit.rollout.servers import ServerPool
        engine = ServerPool(addresses, tokenizer, **options)
    else:
        engine = ServerEngine(addresses[0], tokenizer, **options)
    adapters = adapter_update(model) if push and is_peft(model) and engine.takes_adapters else None
    if adapters is not None:                        # LoRA: the base once, then adapters alone
        engine.update_adapters(*adapters, base=iter(merged_state_dict(model, adapters=False).items()), version=0)
    elif push:
        weights = merged_state_dict(model) if is_peft(model) else model.state_dict()
        engine.update_weights(((n, t.detach()) for n, t in weights.items()), version=0)
    return engine


@register_engine("vllm")
def _vllm(model, tokenizer, rollout=None, **options):
    """vLLM's `LLM` in this process over its own copy of the weights, refreshed after every optimizer
    step (`grpokit.rollout.vllm.VLLMEngine`; options: `rollout.vllm`, then `options`). Needs vLLM
    installed."""
    from grpokit.rollout.vllm import VLLMEngine

    if options.get("lora_rank") is None and rollout is not None and rollout.sync_adapters and hasattr(model, "peft_config"):
        options["lora_rank"] = lora_rank_of(model)        # adapters through vLLM's LoRA, not merged weights
    return VLLMEngine(model, tokenizer, **{**(rollout.vllm.model_dump() if rollout is not None else {}), **options})


def lora_rank_of(model) -> int | None:
    """The largest adapter rank of a PEFT model (what vLLM's LoRA must hold), or None."""
    ranks = [int(c.r) for c in getattr(model, "peft_config", {}).values()]
    return max(ranks) if ranks else None
