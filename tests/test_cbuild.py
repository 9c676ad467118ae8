"""The native kernels' builds (grpokit.cbuild): with OpenMP on PyTorch's own runtime where PyTorch
runs on GNU OpenMP, else (a compiler without OpenMP) with threads of their own, the two builds
computing the same thing."""

import ctypes
import os
import shutil
import stat

import pytest
import torch

from grpokit import cbuild
from grpokit.rollout import native_sample

pytestmark = pytest.mark.skipif(cbuild.compiler() is None or cbuild.off(),
                                reason="no C compiler here (or GRPOKIT_NATIVE=0): no native kernels")


def _gomp_maps() -> set[str]:
    with open("/proc/self/maps") as f:
        return {ln.split()[-1] for ln in f if "/libgomp" in ln}


def _draw(path):
    fn = native_sample._bind(ctypes.CDLL(str(path)))
    x = torch.randn(40, 3000, generator=torch.Generator().manual_seed(1)) * 3
    u = torch.rand(40, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return native_sample.sample(x, 1.3, u, threads=2, fn=fn)


def test_the_openmp_build_runs_on_pytorchs_own_runtime(tmp_path, monkeypatch):
    omp = cbuild.torch_openmp()
    if omp is None:
        pytest.skip("PyTorch here does not run on a GNU OpenMP runtime: kernels use threads of their own")
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    path = cbuild.build(native_sample.SOURCE)
    assert "-omp-" in path.name
    before = _gomp_maps()
    assert _draw(path) is not None
    assert _gomp_maps() == before == {omp}          # no second OpenMP runtime loaded


def test_a_compiler_without_openmp_gives_the_threaded_build_with_the_same_results(tmp_path, monkeypatch):
    real = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    fake = tmp_path / "cc-no-openmp"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && '
                    '{ echo "unsupported option -fopenmp" >&2; exit 1; }; done\n'
                    f'exec {real} "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    plain = cbuild.build(native_sample.SOURCE)
    assert "-omp-" not in plain.name and plain.exists()
    assert os.listdir(plain.parent) == [plain.name]         # the failed OpenMP build left nothing behind
    monkeypatch.setenv("CC", real)
    other = cbuild.build(native_sample.SOURCE)
    a, b = _draw(plain), _draw(other)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
