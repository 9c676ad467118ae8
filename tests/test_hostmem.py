"""grpokit.hostmem: large per-step buffers are reused from the heap instead of faulted in afresh,
and the user's own allocator settings are left alone."""

import json
import subprocess
import sys
import textwrap

import pytest

from grpokit import hostmem

# three 24 MiB buffers alive at once, written, then freed, ten times over (a decoding step's
# logits and sampling buffers, in plain glibc calls: no other allocation moves the heap between
# them); the minor page faults of those ten steps, after three to warm up
CHILD = textwrap.dedent("""
    import ctypes, json, resource
    from grpokit import hostmem
    applied = hostmem.tune()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 24 << 20
    def step():
        bufs = [libc.malloc(size) for _ in range(3)]
        for p in bufs:
            ctypes.memset(p, 1, size)
        for p in bufs:
            libc.free(p)
    for _ in range(3):
        step()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
""")


def _run(**env_extra) -> dict:
    import os
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GRPOKIT_HOST_MALLOC", "GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_tuned_steps_fault_in_no_fresh_pages_and_the_default_allocator_does():
    tuned, plain = _run(), _run(GRPOKIT_HOST_MALLOC="default")
    assert tuned["applied"] is True and plain["applied"] is False
    pages = (24 << 20) // 4096                           # one buffer, in 4 KiB pages
    assert plain["faults"] > 10 * pages                  # glibc's default: fresh pages every step
    assert tuned["faults"] < pages // 4                  # tuned: the freed buffers are reused


@pytest.mark.parametrize("env, why", [
    ({"GRPOKIT_HOST_MALLOC": "default"}, "GRPOKIT_HOST_MALLOC=default"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, "GLIBC_TUNABLES sets glibc.malloc"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "another allocator is preloaded"),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}, None),
    ({}, None),
])
def test_the_users_own_allocator_settings_are_left_alone(env, why):
    assert hostmem._left_alone(env) == why
