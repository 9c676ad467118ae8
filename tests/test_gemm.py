"""grpokit.gemm: oneDNN float32 linears equal F.linear, forward and backward."""

import contextlib

import pytest
import torch

from grpokit import gemm
from tests.fixtures import op_calls

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

    ask = ("from grpokit import gemm; print(gemm.use_onednn(), gemm.use_packed(), "
           "*(gemm.uses(r) for r in gemm.ROLES))")
    for want in (True, False):      # another process takes the kept answers, whatever the timing says
        roles = {name: (want if k % 2 else not want) for k, name in enumerate(gemm.ROLES.values())}
        kept.write_text(json.dumps({"probe": True, "onednn_packed_decode": not want, **roles}))
        out = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True,
                             env={**__import__("os").environ, "GRPOKIT_CACHE": str(tmp_path)}).stdout.split()
        assert out == [str(True), str(not want), *map(str, roles.values())]

    kept.write_text("{not json")
    assert gemm._machine_choice("probe", lambda: False) is False
    assert json.loads(kept.read_text()) == {"probe": False}


ONEDNN = "mkldnn::_linear_pointwise"     # a GEMM through oneDNN, as the profiler names it


@pytest.mark.parametrize("forward", [False, True])
@pytest.mark.parametrize("grad_input", [False, True])
@pytest.mark.parametrize("grad_weight", [False, True])
def test_each_gemm_of_a_linear_takes_the_library_chosen_for_its_role(forward, grad_input, grad_weight):
    """The three GEMMs of `linear` are chosen one by one: oneDNN runs exactly the roles that chose it
    (the forward, and a backward asked for the input's or the weight's gradient alone), and the
    results equal F.linear's whichever ran."""
    roles = {"forward": forward, "grad_input": grad_input, "grad_weight": grad_weight}
    gemm.choose("auto")
    gemm._state["use"] = {**roles, "head_grad_weight": False}
    g = torch.Generator().manual_seed(0)
    x0, w0, b0, gy = (torch.randn(*s, generator=g) for s in ((6, 24), (40, 24), (40,), (6, 40)))
    try:
        for which, want in (("x", grad_input), ("w", grad_weight)):
            x, w, b = (t.clone().requires_grad_(name == which) for t, name in ((x0, "x"), (w0, "w"), (b0, "b")))
            out = {}
            n_fwd = op_calls(lambda: out.setdefault("y", gemm.linear(x, w, b)), ONEDNN)
            n_bwd = op_calls(lambda: out["y"].backward(gy), ONEDNN)
            assert (n_fwd, n_bwd) == (int(forward), int(want))
            ref = torch.nn.functional.linear(x0, w0, b0)
            torch.testing.assert_close(out["y"].detach(), ref, atol=1e-4, rtol=1e-5)
            grad = x.grad if which == "x" else w.grad
            want_grad = gy @ w0 if which == "x" else gy.t() @ x0
            torch.testing.assert_close(grad, want_grad, atol=1e-4, rtol=1e-5)
    finally:
        gemm.choose("auto")


def test_the_head_weight_gradient_has_a_role_of_its_own():
    """`matmul_t` with the head's role follows that role's choice alone."""
    a, bt = torch.randn(30, 200).t(), torch.randn(30, 16).t()       # logits^T [200, 30], h^T [16, 30]
    for head in (False, True):
        gemm.choose("auto")
        gemm._state["use"] = {"forward": True, "grad_input": True, "grad_weight": True, "head_grad_weight": head}
        try:
            out = {}
            assert op_calls(lambda: out.setdefault("m", gemm.matmul_t(a, bt, "head_grad_weight")), ONEDNN) == int(head)
            out = out["m"]
            torch.testing.assert_close(out, a @ bt.t(), atol=1e-4, rtol=1e-5)
        finally:
            gemm.choose("auto")


@pytest.mark.parametrize("grad_weight_onednn", [False, True])
def test_weight_gradients_added_in_place_equal_autograds_accumulation(grad_weight_onednn):
    """Under `grads_in_place`, micro-batches after the first add each weight's gradient into its
    `.grad` with one GEMM (beta = 1): the sums equal autograd's own accumulation, for a weight used
    twice in a pass, a weight with a gradient hook (which must still see every gradient, so it
    keeps autograd's path) and a bias; where oneDNN runs the weight-gradient GEMM (no beta), nothing
    is added in place."""
    gemm.choose("auto")
    gemm._state["use"] = {"forward": True, "grad_input": True, "grad_weight": grad_weight_onednn,
                          "head_grad_weight": False}
    g = torch.Generator().manual_seed(3)
    w0, w1, b1, hooked0 = (torch.randn(*s, generator=g) * 0.3 for s in ((16, 16), (8, 16), (8,), (16, 16)))
    xs = [torch.randn(5 + k, 16, generator=g) for k in range(3)]

    def run(in_place: bool):
        ws = [t.clone().requires_grad_(True) for t in (w0, w1, b1, hooked0)]
        seen = []
        ws[3].register_hook(lambda gr: seen.append(gr.clone()))
        added = []
        for x in xs:
            h = torch.tanh(gemm.linear(x, ws[0]))
            h = torch.tanh(gemm.linear(h, ws[0]))             # the same weight twice in one pass
            h = gemm.linear(torch.tanh(gemm.linear(h, ws[3])), ws[1], ws[2])
            loss = (h ** 2).sum()
            with gemm.grads_in_place() if in_place else contextlib.nullcontext():
                added.append(op_calls(loss.backward, "aten::addmm_"))
        return [w.grad.clone() for w in ws], len(seen), added

    try:
        got, seen_in_place, added = run(True)
        want, seen, added_off = run(False)
    finally:
        gemm.choose("auto")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert seen_in_place == seen == 3
    assert added_off == [0, 0, 0]
    # the first pass finds no .grad; then w0 (twice) and w1 are added in place, the hooked weight not
    assert added == ([0, 0, 0] if grad_weight_onednn else [0, 3, 3])


@pytest.mark.parametrize("hooked", [False, True])
def test_an_embeddings_gradient_added_row_by_row_equals_autograds_accumulation(hooked):
    """`gemm.embedding` under `grads_in_place`: micro-batches after the first add the embedding's
    gradient into `.grad` with `index_add_` (ids repeated within a pass, the weight also tied to an
    output projection), equal to autograd's dense gradients accumulated; a weight with a gradient
    hook (which must see every gradient) and a backward outside the context keep autograd's path."""
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(11, 6, generator=g)
    batches = [torch.tensor([[1, 4, 4, 9], [0, 4, 10, 1]]), torch.tensor([[3, 3, 3]]), torch.tensor([[10, 2, 7, 7, 0]])]

    def run(fast: bool, in_place: bool):
        w = w0.clone().requires_grad_(True)
        seen = []
        if hooked:
            w.register_hook(lambda gr: seen.append(1))
        adds = []
        for ids in batches:
            x = gemm.embedding(ids, w) if fast else torch.nn.functional.embedding(ids, w)
            logits = torch.tanh(x) @ w.t()                      # the tied output projection
            loss = (logits.log_softmax(-1)[..., 0] * torch.arange(1.0, ids.shape[-1] + 1)).sum()
            with gemm.grads_in_place() if in_place else contextlib.nullcontext():
                adds.append(op_calls(loss.backward, "aten::index_add_"))
        return w.grad.clone(), adds, len(seen)

    want, _, seen_want = run(False, False)
    got, adds, seen = run(True, True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert adds == ([0, 0, 0] if hooked else [0, 1, 1]) and seen == seen_want
    got_off, adds_off, _ = run(True, False)
    torch.testing.assert_close(got_off, want, rtol=1e-5, atol=1e-6)
    assert adds_off == [0, 0, 0]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")    # the cycle is broken below
def test_a_backward_that_builds_a_graph_of_the_gradient_keeps_autograds_path():
    """`create_graph=True` (a gradient to differentiate again) turns grad mode on in backward: the
    weight's gradient must come back through autograd, with its graph, not be added in place."""
    gemm.choose("auto")
    gemm._state["use"] = {"forward": True, "grad_input": True, "grad_weight": False, "head_grad_weight": False}
    try:
        w = torch.randn(6, 6, requires_grad=True)
        x = torch.randn(4, 6)
        gemm.linear(x, w).pow(2).sum().backward()             # a first pass: .grad exists
        with gemm.grads_in_place():
            n = op_calls(lambda: gemm.linear(x, w).pow(2).sum().backward(create_graph=True), "aten::addmm_")
        assert n == 0 and w.grad.requires_grad
        torch.testing.assert_close(w.grad.detach(), 2 * (2 * (x @ w.t()).t() @ x), rtol=1e-5, atol=1e-5)
        w.grad = None
    finally:
        gemm.choose("auto")
