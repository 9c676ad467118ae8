"""The local training worker against the reusable worker conformance checks, plain and LoRA."""

import pytest
import torch

from grpokit.config import load_config
from grpokit.data.datasets import load_prompts
from grpokit.train.batch import from_rollout
from grpokit.models import load_tokenizer
from grpokit.train.build import build_policy
from grpokit.train.worker import LocalWorker, lr_lambda
from grpokit.train import build_run
from tests.fixtures import tiny_run_inputs
from tests.train.worker_conformance import check_worker


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("worker"))


def _factory(setup, name, **extra):
    root, model_dir, train, _ = setup
    over = {"model.path": model_dir, "data.path": train, "train.run_dir": root / name, "rollout.group_size": 4,
            "rollout.batch_size": 8, "rollout.max_new_tokens": 5, "rollout.temperature": 1.0, "optim.lr": 1e-2,
            "optim.micro_batch_size": 3, "train.steps": 4, "monitor.sinks": "[jsonl]",
            "algorithm.kl.beta": 0.05, "algorithm.kl.controller": "fixed", "rewards": "[{name: test_varied}]",
            **extra}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    tok = load_tokenizer(model_dir)
    rows = load_prompts(train).rows[:2]

    def make_worker():
        torch.manual_seed(0)
        policy, reference = build_policy(cfg)
        return LocalWorker(cfg, policy, tok, reference)

    def make_batch(worker):
        tr = build_run(cfg, worker=worker, tokenizer=tok, dataset=load_prompts(train), health=False, report=False)
        tr.gen.manual_seed(1)
        b = from_rollout(tr.sample(rows), [0, 1], rows, 4)
        return tr.score(b)

    return make_worker, make_batch


def test_local_worker_conforms(setup):
    check_worker(*_factory(setup, "plain"))


def test_local_lora_worker_conforms(setup):
    check_worker(*_factory(setup, "lora", **{"lora.enabled": True, "lora.rank": 4, "lora.reference": "copy"}))


def test_lr_schedule_warms_up_then_decays():
    f = lr_lambda(2, "cosine", 6)
    assert [f(s) for s in range(2)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(4) == pytest.approx(0.5) and f(6) == pytest.approx(0.0)
    assert lr_lambda(0, "linear", 4)(1) == pytest.approx(0.75) and lr_lambda(0, "constant", 4)(3) == 1.0


def test_adamw_is_fused_for_plain_tensors_and_keeps_it_across_a_loaded_state():
    from grpokit.train.worker import adamw

    g = torch.Generator().manual_seed(0)
    w0 = [torch.randn(7, 5, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn_like(w) for w in w0] for _ in range(4)]
    runs = {}
    for fused in (True, False):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = adamw(params, lr=1e-2, weight_decay=0.1) if fused else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        for gs in grads:
            for p, gr in zip(params, gs):
                p.grad = gr.clone()
            opt.step()
        runs[fused] = (params, opt)
    assert runs[True][1].param_groups[0]["fused"] is True
    for a, b in zip(runs[True][0], runs[False][0]):          # the same update as the multi-tensor form
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt = runs[True][1]
    opt.load_state_dict(runs[False][1].state_dict())          # a checkpoint saved by a non-fused run
    assert opt.param_groups[0]["fused"] is True
    opt.step()                                                # and it still steps
