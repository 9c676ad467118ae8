"""The pieces every health rule shares: the `Alarm` a rule returns, the strict config base
(`AlarmConfig`), the rule registry (`RULES`, `register_rule`) and the history helpers rules read
their metrics with (`_num`, `_tail`, `_head`, `_step`, `kendall_tau`, `_slope`).

A *rule* is a plain function ``rule(history, params) -> Alarm | None``. ``history`` is the list of
metric dicts logged so far, oldest first, each with a ``"step"`` key (the rows of
``metrics.jsonl``); ``params`` is that rule's own small config model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, model_validator

from grpokit._names import did_you_mean

Action = Literal["warn", "stop", "off"]
History = Sequence[Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Alarm:
    """One firing of a rule at one step. ``severity`` is the rule's configured action."""

    name: str
    step: int
    severity: Literal["warn", "stop"]
    message: str
    advice: str
    value: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alarm:
        value = d.get("value")
        return cls(
            name=str(d["name"]),
            step=int(d.get("step", -1)),
            severity="stop" if d.get("severity") == "stop" else "warn",
            message=str(d.get("message", "")),
            advice=str(d.get("advice", "")),
            value=float(value) if isinstance(value, (int, float)) else math.nan,
        )


# --------------------------------------------------------------------------------------------
# Config


class _Strict(BaseModel):
    """Forbids unknown keys, naming the key and the closest valid one."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            valid = list(cls.model_fields)
            for key in data:
                if key not in valid:
                    hint = did_you_mean(key, valid) or f"; valid keys: {valid}"
                    raise ValueError(f"unknown key {key!r} in {cls.__name__}{hint}")
        return data


class AlarmConfig(_Strict):
    action: Action = "warn"
    """What a firing does: 'warn' logs and prints it, 'stop' also asks the trainer to stop,
    'off' disables the rule."""


# --------------------------------------------------------------------------------------------
# Registry and helpers


@dataclasses.dataclass(frozen=True)
class Rule:
    fn: Callable[[History, Any], Alarm | None]
    params_type: type[AlarmConfig]
    keys: tuple[str, ...]
    """The metrics the rule reads: the monitor keeps only these, and the report marks their plots.
    A key may hold `*` (`reward/*/none_frac`: every reward's), matched with fnmatch."""


RULES: dict[str, Rule] = {}


def register_rule(name: str, params_type: type[AlarmConfig], keys: Iterable[str]):
    """Register ``fn(history, params) -> Alarm | None`` under ``name``."""

    def deco(fn):
        RULES[name] = Rule(fn, params_type, tuple(keys))
        return fn

    return deco


BUILTIN_RULES: dict[str, Rule] = {}
"""This package's own rules by name. `grpokit.monitor.health.config` registers them into `RULES`
in `HealthConfig`'s field order, so the order the monitor runs them and reports their alarms does
not depend on which module defines which rule."""


def builtin_rule(name: str, params_type: type[AlarmConfig], keys: Iterable[str]):
    """Like `register_rule`, for the built-in rules: collects ``fn`` into `BUILTIN_RULES`."""

    def deco(fn):
        BUILTIN_RULES[name] = Rule(fn, params_type, tuple(keys))
        return fn

    return deco


def _num(v: Any) -> float | None:
    """v as a finite float, or None (missing, NaN, inf, bool, non-numeric)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _tail(history: History, key: str, n: int, end: int | None = None) -> list[float]:
    """The last ``n`` finite values of ``key`` in ``history[:end]``, oldest first."""
    out: list[float] = []
    stop = len(history) if end is None else end
    for i in range(stop - 1, -1, -1):
        v = _num(history[i].get(key))
        if v is not None:
            out.append(v)
            if len(out) == n:
                break
    out.reverse()
    return out


def _head(history: History, key: str, n: int) -> list[float]:
    """The first ``n`` finite values of ``key`` in ``history``."""
    out: list[float] = []
    for entry in history:
        v = _num(entry.get(key))
        if v is not None:
            out.append(v)
            if len(out) == n:
                break
    return out


def _step(history: History) -> int:
    return int(history[-1].get("step", len(history) - 1)) if history else -1


def kendall_tau(x: Sequence[float]) -> float:
    """Kendall's tau-a of ``x`` against its index: (concordant − discordant pairs) / (n(n−1)/2)."""
    a = np.asarray(x, dtype=float)  # [n]
    n = a.size
    if n < 2:
        return 0.0
    sign = np.sign(a[None, :] - a[:, None])  # [n, n], +1 where a later value is larger
    return float(np.triu(sign, k=1).sum() / (n * (n - 1) / 2))


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (0 when xs are all equal)."""
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    dx = x - x.mean()
    den = float((dx * dx).sum())
    return float((dx * (y - y.mean())).sum() / den) if den > 0 else 0.0

