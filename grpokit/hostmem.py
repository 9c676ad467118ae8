"""Host memory reuse: keep glibc's allocator from handing large freed buffers back to the kernel
between the steps that allocate them again.

A CPU decoding step allocates buffers of 12-25 MB and frees them before the next step: the logits
[rows, vocabulary] of a 49,152-token vocabulary at 64 rows are 12.6 MB, and sampling makes a few
more of that size. glibc serves requests past its mmap threshold with fresh `mmap` pages and
returns them with `munmap` on free (its dynamic threshold rises after such a free, but every
release of the heap's top past the trim threshold hands the pages back again), so each step
touches fresh pages: about 12,000 minor page faults a step, each page zeroed by the kernel. Measured
on SmolLM2-135M, 64 rows, one thread: sampling took 28-53 ms a step with the faults and 10-12 ms
without them (docs/performance.md).

`tune()` raises the mmap threshold to glibc's maximum (32 MiB on 64-bit systems) and the trim
threshold to 512 MiB, so buffers up to 32 MiB come from the heap and stay there after they are
freed, to be reused by the next step. Larger buffers (training activations) are mapped and unmapped
as before. What the process holds after a peak stays near that peak instead of shrinking; the peak
itself is the same live memory (it is what a preloaded jemalloc or tcmalloc does, the allocators
PyTorch's CPU performance guides recommend). Nothing is changed where the user has chosen: with
MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or glibc malloc tunables in the environment, another
allocator preloaded, or GRPOKIT_HOST_MALLOC=default. Off glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20          # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit systems
TRIM_THRESHOLD = 512 << 20

_done: dict = {}


def _left_alone(env) -> str | None:
    """Why the allocator is left as it is (the user's own choice), or None."""
    if env.get("GRPOKIT_HOST_MALLOC", "").lower() in ("default", "0", "off", "false"):
        return "GRPOKIT_HOST_MALLOC=default"
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if var in env:
            return f"{var} is set"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    if any(a in env.get("LD_PRELOAD", "") for a in ("jemalloc", "tcmalloc", "mimalloc")):
        return "another allocator is preloaded"
    return None


def tune(env=None) -> bool:
    """Apply the thresholds once per process; True where they are in effect (now or before)."""
    if "applied" in _done:
        return _done["applied"]
    env = os.environ if env is None else env
    why = _left_alone(env)
    applied = False
    if why is None and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None)
            if hasattr(libc, "gnu_get_libc_version"):                  # glibc, not musl
                applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                    bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):
            applied = False
    if why is not None:
        log.info("host allocator left as it is: %s", why)
    elif applied:
        log.debug("host allocator: buffers up to %d MiB reused from the heap", MMAP_THRESHOLD >> 20)
    _done["applied"] = applied
    return applied
