"""grpokit's small C kernels: built once per machine with the system's C compiler, loaded through
ctypes, checked against PyTorch before first use, and replaced by the PyTorch path on any failure.

The sources are in grpokit/csrc/: the decoding step's attention (attend.c, `grpokit.rollout.native`),
the sampler's plain path (sample.c, `grpokit.rollout.native_sample`), the LM head's fused
log-probabilities (head_logp.c, `grpokit.train.head`), the training forward's attention
(packed_attend.c, `grpokit.train.packed_attention`) and its RMSNorm and SwiGLU (layer_ops.c,
`grpokit.train.layer_ops`), with what they share in simd.h and threads.h.
Where PyTorch runs on GNU OpenMP, their jobs run on its thread team (`torch_openmp`).

Why plain C through ctypes and not a PyTorch C++ extension: a kernel compiles in about a second (a
`torch/extension.h` build takes tens of seconds), needs no build tool beyond `cc`, and each entry
point takes pointers and strides. ctypes releases the GIL during a call.

A library is built into `$GRPOKIT_CACHE/native` (default `~/.cache/grpokit/native`), named by a
hash of its source and the headers beside it, the compiler and flags, and the CPU's model and instruction sets, so a cache
shared between different machines never loads a build for another CPU; a build is written to a
temporary file and renamed, so concurrent processes never load a half-written one. `CC` picks the
compiler (it may carry arguments: `CC="ccache gcc"`); GRPOKIT_NATIVE=0 turns every kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from grpokit.cache import cache_dir, cpu_id

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread"]
CSRC = Path(__file__).with_name("csrc")


def off() -> bool:
    return os.environ.get("GRPOKIT_NATIVE", "1").lower() in ("0", "off", "false", "no")


def compiler() -> list[str] | None:
    """The C compiler command: `CC` (split as a shell would), else cc, gcc or clang on PATH."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")]
    return cc if cc[0] and shutil.which(cc[0]) else None


def torch_openmp() -> str | None:
    """The path of the GNU OpenMP runtime PyTorch's CPU operations run on, when that is their
    parallel backend and the runtime is loaded in this process (Linux wheels ship their own
    libgomp), else None. A kernel linked against this very file (not the system's libgomp, which
    may be a second copy under another name) runs its jobs on the same thread team as PyTorch's
    GEMMs: threads of its own would compete, on a small machine, with that team's workers, which
    spin for a while after each parallel region (on two cores a decoding step's attention took about
    twice as long inside the step as alone; docs/performance.md)."""
    try:
        import torch
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        with open("/proc/self/maps") as f:
            found = {ln.split()[-1] for ln in f if "/libgomp" in ln and ".so" in ln.split()[-1]}
    except (ImportError, OSError, RuntimeError):
        return None
    own = [p for p in found if p.startswith(os.path.dirname(torch.__file__) + os.sep)]
    if own or len(found) == 1:          # the wheel's own copy, or the only one (a system build's)
        return (own or sorted(found))[0]
    return None                         # none, or several and none of them PyTorch's: unknown


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        first = ((res.stderr or res.stdout).strip().splitlines() or ["no output"])[0]
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {first}")


def build(source: Path) -> Path:
    """The shared library of `source` for this machine: from the cache, or compiled now. Where
    PyTorch runs on a GNU OpenMP runtime (`torch_openmp`), the kernel is compiled with OpenMP and
    linked against that runtime (grpokit/csrc/threads.h: its jobs on PyTorch's thread team); if that
    build fails, or elsewhere, with threads of its own."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) found")
    omp = torch_openmp()
    src = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    ident = src + " ".join([*cc, *FLAGS]).encode() + cpu_id().encode()
    plain = cache_dir("native") / f"{source.stem}-{hashlib.sha256(ident).hexdigest()[:16]}.so"
    if omp is None:
        return _build(cc, source, plain, None)
    # the runtime's path names the build: a PyTorch with another runtime gets a build of its own
    out = cache_dir("native") / f"{source.stem}-omp-{hashlib.sha256(ident + omp.encode()).hexdigest()[:16]}.so"
    try:
        return _build(cc, source, out, omp)
    except RuntimeError as e:
        log.info("native %s: no OpenMP build (%s); threads of its own", source.stem, e)
        return _build(cc, source, plain, None)


def _build(cc: list[str], source: Path, out: Path, omp: str | None) -> Path:
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        if omp is None:
            _run([*cc, *FLAGS, "-I", str(source.parent), "-o", tmp, str(source), "-lm"])
        else:        # compiled with OpenMP, linked against the runtime file itself (no -lgomp)
            _run([*cc, *FLAGS, "-fopenmp", "-c", "-I", str(source.parent), "-o", obj, str(source)])
            _run([*cc, *FLAGS, "-o", tmp, obj, omp, "-lm"])
        os.replace(tmp, out)
    finally:
        for f in (tmp, obj):
            if os.path.exists(f):
                os.unlink(f)
    return out


def load(what: str, source: Path, bind, check):
    """`bind(ctypes.CDLL)` -> the kernel's entry point(s), then `check(them)` (raises on a mismatch
    with PyTorch); returns them, or None (GRPOKIT_NATIVE=0, no compiler, a failed build or check:
    one logged line, naming `what`). Call once per process and keep the result."""
    if off():
        log.info("native %s off (GRPOKIT_NATIVE=0): PyTorch instead", what)
        return None
    try:
        t = time.perf_counter()
        path = build(source)
        fns = bind(ctypes.CDLL(str(path)))
        check(fns)
        log.info("native %s ready in %.1f s (%s)", what, time.perf_counter() - t, path.name)
        return fns
    except Exception as e:                     # noqa: BLE001 - any failure: PyTorch, said once
        log.warning("native %s unavailable, PyTorch instead: %s", what, e)
        return None
