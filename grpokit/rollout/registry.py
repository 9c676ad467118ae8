"""Rollout engines by name: `rollout.engine` in config names a factory registered here.

A factory is called as `factory(model, tokenizer, **options)` and returns an engine: an object with
`generate(prompt_ids, params, generator) -> RolloutBatch` (`grpokit.rollout.base.RolloutEngine`).
This module imports nothing heavy: a factory imports its engine when it is called.
"""

from __future__ import annotations

from typing import Any, Callable

from grpokit._names import lookup

__all__ = ["ENGINES", "EngineFactory", "get_engine", "register_engine"]

EngineFactory = Callable[..., Any]
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory | None = None, *, overwrite: bool = False):
    """Register `factory(model, tokenizer, **options) -> engine` under `name` (also a decorator)."""

    def _add(f: EngineFactory) -> EngineFactory:
        if name in ENGINES and ENGINES[name] is not f and not overwrite:
            raise ValueError(f"rollout engine {name!r} is already registered")
        ENGINES[name] = f
        return f

    return _add if factory is None else _add(factory)


def get_engine(name: str) -> EngineFactory:
    """The factory registered as `name`; ValueError naming the closest registered name."""
    return lookup(ENGINES, name, "rollout engine", listing="registered")


@register_engine("hf")
def _hf(model, tokenizer, **options):
    """In-process generation with the transformers model itself (`grpokit.rollout.hf.HFEngine`)."""
    from grpokit.rollout.hf import HFEngine

    return HFEngine(model, tokenizer)
