"""Rollout engines by name: `rollout.engine` in the config selects one.

A factory takes (policy, tokenizer, cfg) and returns a `grpokit.rollout.base.RolloutEngine`.
Register your own with `register_engine("name", factory)` before the config is validated.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from grpokit._names import lookup

EngineFactory = Callable[..., Any]
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory | None = None, *, overwrite: bool = False):
    """Add an engine factory `factory(policy, tokenizer, cfg) -> RolloutEngine`; usable as a decorator."""
    def _add(f: EngineFactory) -> EngineFactory:
        if name in ENGINES and not overwrite:
            raise ValueError(f"rollout engine {name!r} is already registered")
        ENGINES[name] = f
        return f
    return _add(factory) if factory is not None else _add


def get_engine(name: str) -> EngineFactory:
    return lookup(ENGINES, name, "rollout engine")


def build_engine(name: str, policy, tokenizer, cfg=None):
    return get_engine(name)(policy, tokenizer, cfg)


def _hf(policy, tokenizer, cfg=None):
    """transformers, in-process, sampling with the policy module itself (no weight sync)."""
    from grpokit.rollout.hf import HFEngine
    return HFEngine(policy, tokenizer)


def _hf_copy(policy, tokenizer, cfg=None):
    """transformers, in-process, over its own frozen copy of the weights, refreshed from the
    trainer after every optimizer step: the decoupled-engine path (weight sync, pi_old
    recomputed, importance correction) without another process. A LoRA policy's copy is a plain
    model holding the merged weights."""
    from grpokit.rollout.hf import HFEngine
    if hasattr(policy, "get_base_model"):           # PEFT: a plain model of the base's architecture
        from transformers import AutoModelForCausalLM

        from grpokit.train.lora import merged_state_dict
        config = copy.deepcopy(policy.get_base_model().config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        merged = merged_state_dict(policy)
        model = AutoModelForCausalLM.from_config(config, dtype=next(iter(merged.values())).dtype)
        model.load_state_dict(merged, strict=False)   # a tied LM head is not in the merged dict
        model.to(next(policy.parameters()).device)
    else:
        model = copy.deepcopy(policy)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return HFEngine(model, tokenizer, owns_weights=True)


register_engine("hf", _hf)
register_engine("hf_copy", _hf_copy)
