"""Rollout: sampling G completions per prompt. Engines are chosen by name (`rollout.engine`) from
`ENGINES`; `register_engine(name, factory)` adds one. Importing this package is cheap: an engine's
module (torch, transformers) is imported when its factory runs."""

from grpokit.rollout.registry import ENGINES, build_engine, get_engine, register_engine

__all__ = ["ENGINES", "build_engine", "get_engine", "register_engine"]
