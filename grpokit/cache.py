"""grpokit's on-disk cache: `$GRPOKIT_CACHE/<part>`, else `~/.cache/grpokit/<part>` (converted GGUF
models under `gguf/`, the native kernels' builds under `native/`, the CPU GEMM choice under `gemm/`)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CACHE_ENV = "GRPOKIT_CACHE"


def cache_dir(part: str) -> Path:
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpokit"
    return Path(base).expanduser() / part


def cpu_id() -> str:
    """The CPU model and instruction-set flags (what -march=native compiles for; what a choice timed
    on this machine holds for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()
