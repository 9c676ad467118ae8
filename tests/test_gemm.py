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
