"""grpokit's on-disk cache: `$GRPOKIT_CACHE/<part>`, else `~/.cache/grpokit/<part>` (converted GGUF
models under `gguf/`, the native decode attention's builds under `native/`)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "GRPOKIT_CACHE"


def cache_dir(part: str) -> Path:
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpokit"
    return Path(base).expanduser() / part
