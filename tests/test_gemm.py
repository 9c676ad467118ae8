"""grpokit.gemm: oneDNN float32 linears equal F.linear, forward and backward."""

import pytest
import torch

from grpokit import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def onednn():
    gemm.choose("onednn")
    yield
    gemm.choose("auto")


def test_linear_and_its_gradients_equal_f_linear(onednn):
    x = torch.randn(3, 17, 24, requires_grad=True)
    w = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    gy = torch.randn(3, 17, 40)
    y = gemm.linear(x, w, b)
    y.backward(gy)
    got = [y.detach()] + [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    y = torch.nn.functional.linear(x, w, b)
    y.backward(gy)
    for a, e in zip(got, [y.detach()] + [t.grad for t in (x, w, b)]):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-5)


def test_packed_weight_and_the_module_patch(onednn):
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16)
    ref = lin(x)
    torch.testing.assert_close(gemm.linear(x, gemm.pack(lin.weight, 5), lin.bias), ref, atol=1e-5, rtol=1e-5)
    with gemm.fast_linears(lin):
        assert "forward" in lin.__dict__
        torch.testing.assert_close(lin(x), ref, atol=1e-5, rtol=1e-5)
    assert "forward" not in lin.__dict__                       # restored


def test_blas_mode_leaves_f_linear():
    gemm.choose("blas")
    try:
        lin = torch.nn.Linear(4, 4)
        with gemm.fast_linears(lin):
            assert "forward" not in lin.__dict__
        assert gemm.pack(lin.weight, 4) is lin.weight
    finally:
        gemm.choose("auto")


def test_the_auto_choice_is_kept_per_machine_and_read_by_other_processes(tmp_path, monkeypatch):
    """`auto` times once per machine: the answer kept in the cache is what every later process takes
    (so a server and the ranks round alike), and a broken file is timed again and rewritten."""
    import json
    import subprocess
    import sys

    monkeypatch.setenv("GRPOKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("GRPOKIT_CPU_GEMM", raising=False)
    calls = []
    assert gemm._machine_choice("probe", lambda: calls.append(1) or True) is True
    assert gemm._machine_choice("probe", lambda: calls.append(1) or False) is True      # kept, not retimed
    assert calls == [1]
    [kept] = (tmp_path / "gemm").glob("choice-*.json")

    ask = "from grpokit import gemm; print(gemm.use_onednn(), gemm.use_packed())"
    for want in (True, False):      # another process takes the kept answer, whatever the timing says
        kept.write_text(json.dumps({"probe": True, "onednn_linear": want, "onednn_packed_decode": not want}))
        out = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True,
                             env={**__import__("os").environ, "GRPOKIT_CACHE": str(tmp_path)}).stdout.split()
        assert out == [str(want), str(not want)]

    kept.write_text("{not json")
    assert gemm._machine_choice("probe", lambda: False) is False
    assert json.loads(kept.read_text()) == {"probe": False}
