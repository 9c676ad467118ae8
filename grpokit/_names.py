"""One helper for every "did you mean" hint, every registry lookup (an unknown name fails with the
closest valid one) and every registration."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


def closest(word, options: Iterable, *, cutoff: float = 0.6) -> str | None:
    """The option closest to `word` (difflib ratio >= cutoff), or None."""
    hits = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=cutoff)
    return hits[0] if hits else None


def did_you_mean(word, options: Iterable, *, cutoff: float = 0.6) -> str:
    """`"; did you mean 'x'?"` for the closest option, or "" when none is close."""
    hit = closest(word, options, cutoff=cutoff)
    return f"; did you mean {hit!r}?" if hit is not None else ""


def lookup(table: Mapping[str, T], name, what: str, *, listing: str = "known") -> T:
    """`table[name]`, or a one-line ValueError naming `what`, the closest name and the known ones."""
    try:
        return table[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name (a list from YAML)
        raise ValueError(f"unknown {what} {name!r}{did_you_mean(name, table)} "
                         f"({listing}: {', '.join(sorted(table))})") from None


def register(table: dict, name: str, obj=None, *, what: str, overwrite: bool = False):
    """Add `obj` to a registry `table` under `name`, or, with `obj` None, return a decorator that
    does. A name already taken is a ValueError unless `overwrite`. Every registry's `register_*`
    is this."""
    def _add(o):
        if name in table and not overwrite:
            raise ValueError(f"{what} {name!r} is already registered")
        table[name] = o
        return o
    return _add if obj is None else _add(obj)
