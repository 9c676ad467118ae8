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


def _run(setup, name, coef, **extra):
    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / name, **{
        "rewards": "[{name: test_constant}]", "algorithm.kl.beta": 0.0, "algorithm.kl.measure_every": 0,
        "algorithm.entropy_coef": coef, "train.steps": 4, "optim.lr": 1e-2, "rollout.max_new_tokens": 6, **extra}))
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


def test_entropy_control_worked_example():
    """Skywork-OR1's rule: c moves by the step towards holding the target, within [0, max], and
    acts only after a step whose entropy was at or below the target."""
    from grpokit.algo.entropy import EntropyControl

    ctl = EntropyControl(target=0.5, step=0.001, max_coef=0.0025)
    assert ctl.active == 0.0
    got = [ctl.update(e) for e in (0.9, 0.4, 0.3, 0.45, 0.2, 0.6, 0.1, float("nan"), 0.7)]
    # c: 0 (floor) -> .001 -> .002 -> .0025 (cap) -> .0025 -> .0015 -> .0025 -> (nan: kept) -> .0015
    assert got == pytest.approx([0.0, 0.001, 0.002, 0.0025, 0.0025, 0.0, 0.0025, 0.0025, 0.0])
    assert ctl.coef == pytest.approx(0.0015)              # held, but inactive above the target
    other = EntropyControl(target=0.5, step=0.001, max_coef=0.0025)
    other.load_state_dict(ctl.state_dict())
    assert (other.coef, other.active) == (ctl.coef, ctl.active)


def test_the_trainer_raises_the_bonus_while_entropy_is_below_target(setup):
    """Entropy far below a high target: the coefficient grows by the step each step and the bonus
    appears from the second update; above a low target: no bonus ever, the policy unmoved (zero
    advantages)."""
    varied = {"rewards": "[{name: test_varied}]"}       # entropy is measured on rows that train
    rows, _ = _run(setup, "ctl_low", 0.0, **varied, **{"algorithm.entropy_target": 100.0,
                                                       "algorithm.entropy_coef_step": 0.1, "algorithm.entropy_coef_max": 1.0})
    assert [r["policy/entropy_coef"] for r in rows] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert "loss/entropy_bonus" not in rows[0]
    for prev, r in zip(rows, rows[1:]):          # update k+1 used the coefficient set after update k
        assert r["loss/entropy_bonus"] == pytest.approx(prev["policy/entropy_coef"] * r["policy/entropy"], rel=0.05)
    rows, _ = _run(setup, "ctl_high", 0.0, **varied, **{"algorithm.entropy_target": 1e-3})
    assert all(r["policy/entropy_coef"] == 0.0 and "loss/entropy_bonus" not in r for r in rows)
    # zero advantages (a collapsed policy's groups all agree): the entropy is still measured, the
    # coefficient rises and the bonus moves the policy
    rows, moved = _run(setup, "ctl_idle", 0.0, **{"algorithm.entropy_target": 100.0})
    assert [r["policy/entropy_coef"] for r in rows] == pytest.approx([0.0005 * k for k in (1, 2, 3, 4)]) and moved
    with pytest.raises(Exception, match="above entropy_coef_max"):
        load_config(None, ["algorithm.entropy_target=0.3", "algorithm.entropy_coef=0.5"])
