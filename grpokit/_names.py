"""One helper for every registry lookup: unknown names fail with the closest valid one."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """`table[name]`, or a one-line ValueError naming `what`, the closest name and the known ones."""
    if name in table:
        return table[name]
    close = difflib.get_close_matches(str(name), list(table), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown {what} {name!r}{hint} (known: {', '.join(sorted(table))})")
