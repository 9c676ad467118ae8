"""The reward registry: one uniform signature, looked up by name from config.

A reward is a plain function

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

returning one score per completion (None = this sample cannot be scored, e.g. no reference).
`columns` holds every dataset column of the prompt plus `completion_length`, `finish_reason`,
`group_id` and `max_new_tokens`, each a list aligned with `completions`; config `args` arrive as
extra keyword arguments. Every reward must accept and ignore columns it does not use.

A reward that reads dataset columns declares them (`columns=`), so a dataset without one is refused
before the model is loaded (`grpokit.rewards.user.check_columns`); a function that does not declare
them is read from its signature (its required parameters besides prompts and completions).

A reward may also say *why* a completion fails: `@diagnoses(reward)` attaches a function with the
same signature returning, per completion, a short sentence (the value given against the expected
one, the failing test and its error) or None. Wrong-answer rewriting writes it into the note it
teaches (grpokit.data.rewrite); it is called only on the few completions rewritten each step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Callable, Protocol

from grpokit._names import lookup


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]: ...


REGISTRY: dict[str, Callable[..., list]] = {}


def register(name: str, *, own_time_limit: bool = False, columns=None):
    """Decorator: `@register("math_accuracy")` makes the function selectable from config.

    columns: the dataset columns the reward reads, checked against the dataset at start: a list of
    names, in which `{arg}` stands for the value of the reward's argument `arg` (its default unless
    config `args` set it; `["{answer_column}"]`), or a callable `args -> list of names`. None:
    inferred from the signature (grpokit.rewards.user.required_columns).

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
        if columns is not None:
            fn.required_columns = columns if callable(columns) else tuple(columns)
        return fn

    return deco


def diagnoses(reward_fn):
    """Decorator: the function below is `reward_fn`'s diagnosis (`reward_fn.diagnose`), called
    like the reward with the same columns and arguments, returning a sentence or None per
    completion."""

    def deco(fn):
        reward_fn.diagnose = fn
        return fn

    return deco


_SCOPED = threading.RLock()


@contextmanager
def registered_while(rewards: Sequence[tuple[str, Callable[..., list]]]) -> Iterator[list[str]]:
    """Register each `(name, fn)` for the duration of the block only; yields the names used: `name`,
    or `name_2`, `name_3`, ... when it is taken by another function (a function registered under
    `name` already keeps it). Such blocks run one at a time, so none sees another's names, and the
    registry is as before once the block ends."""
    with _SCOPED:
        names, added = [], []
        try:
            for name, fn in rewards:
                used, k = name, 1
                while used in REGISTRY and REGISTRY[used] is not fn:
                    k += 1
                    used = f"{name}_{k}"
                if used not in REGISTRY:
                    register(used, own_time_limit=getattr(fn, "own_time_limit", False))(fn)
                    added.append(used)
                names.append(used)
            yield names
        finally:
            for name in added:
                REGISTRY.pop(name, None)


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
