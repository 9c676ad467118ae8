"""`algorithm.entropy_coef`: an entropy bonus in the loss (off by default), the remedy the
entropy-collapse alarm names. Its gradient is the entropy's own (checked against torch's
Categorical), and in a run whose advantages are all zero it alone moves the policy, towards more
entropy."""

import json
import math

import pytest
import torch

from grpokit.config import load_config
from grpokit.models import load_tokenizer
from grpokit.rewards import REGISTRY, register
from grpokit.train import build_trainer
from grpokit.train.logprobs import _head_logprobs
from tests.fixtures import small_overrides, tiny_run_inputs

if "test_constant" not in REGISTRY:
    @register("test_constant")
    def _constant(prompts, completions, **columns):
        """Every completion alike: every group's advantages are zero."""
        return [1.0] * len(completions)


def test_the_differentiable_entropy_is_the_categoricals_with_its_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    h = torch.randn(3, 5, 8, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    _, ent = _head_logprobs(head, None, 0.7, h, targets, "grad")
    want = torch.distributions.Categorical(logits=head(h) / 0.7).entropy()
    torch.testing.assert_close(ent, want, rtol=1e-5, atol=1e-6)
    g1, = torch.autograd.grad(ent.sum(), h)
    g2, = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    _, detached = _head_logprobs(head, None, 0.7, h, targets, True)
    assert not detached.requires_grad and torch.allclose(detached, want.detach(), atol=1e-6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("entropy"))


def _run(setup, name, coef):
    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / name, **{
        "rewards": "[{name: test_constant}]", "algorithm.kl.beta": 0.0, "algorithm.kl.measure_every": 0,
        "algorithm.entropy_coef": coef, "train.steps": 4, "optim.lr": 1e-2, "rollout.max_new_tokens": 6}))
    torch.manual_seed(0)
    tr = build_trainer(cfg, health=False)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    rows = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    moved = any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    return rows, moved


def test_with_zero_advantages_the_bonus_alone_moves_the_policy_towards_entropy(setup):
    rows, moved = _run(setup, "off", 0.0)
    assert not moved and "loss/entropy_bonus" not in rows[-1]          # off: nothing to learn from
    rows, moved = _run(setup, "on", 0.5)
    assert moved
    ent = [r["policy/entropy"] for r in rows]
    print(f"\nentropy per step with the bonus: {[round(e, 3) for e in ent]}")
    top = math.log(len(load_tokenizer(setup[1])))                  # the uniform policy's entropy
    assert top - ent[-1] < 0.5 * (top - ent[0])                        # the tiny model starts near it
    assert all(r["loss/entropy_bonus"] == pytest.approx(0.5 * r["policy/entropy"], rel=0.05) for r in rows)
