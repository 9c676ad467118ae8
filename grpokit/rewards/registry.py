"""The reward registry: one uniform signature, looked up by name from config.

A reward is a plain function

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

returning one score per completion (None = this sample cannot be scored, e.g. no reference).
`columns` holds every dataset column of the prompt plus `completion_length`, `finish_reason`,
`group_id` and `max_new_tokens`, each a list aligned with `completions`; config `args` arrive as
extra keyword arguments. Every reward must accept and ignore columns it does not use.
"""

from __future__ import annotations

from typing import Callable, Protocol

from grpokit._names import lookup


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]: ...


REGISTRY: dict[str, Callable[..., list]] = {}


def register(name: str, *, own_time_limit: bool = False):
    """Decorator: `@register("math_accuracy")` makes the function selectable from config.

    own_time_limit=True declares that the reward bounds every sample itself (a hard per-sample
    limit after which the sample scores, e.g. 0 for a timeout) and always returns; it then runs
    without the composer's per-call budget unless its config sets `timeout_s` (a budget over the
    whole batch would turn a batch of slow, pathological answers into None, i.e. no penalty)."""

    def deco(fn):
        old = REGISTRY.get(name)
        ident = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
        if old is not None and old is not fn and ident(old) != ident(fn):  # a re-definition replaces
            raise ValueError(f"reward {name!r} is already registered by {ident(old)[0]}.{ident(old)[1]}")
        REGISTRY[name] = fn
        fn.reward_name = name
        fn.own_time_limit = bool(own_time_limit)
        return fn

    return deco


def get(name: str) -> Callable[..., list]:
    """The registered reward `name`; ValueError naming it and the closest registered name."""
    return lookup(REGISTRY, name, "reward", listing="registered")


def read_column(reward: str, column: str, columns: dict, n: int) -> list:
    """The dataset column `column` from a reward's `columns`, checked to hold one value per
    completion: KeyError naming the missing column and the ones present, ValueError on a length
    mismatch. Every reward that reads a column (the reference answer, the tests) uses this."""
    if column not in columns:
        raise KeyError(f"{reward} needs the dataset column {column!r} (have: {sorted(columns)})")
    vals = list(columns[column])
    if len(vals) != n:
        raise ValueError(f"{reward}: column {column!r} has {len(vals)} entries for {n} completions")
    return vals
