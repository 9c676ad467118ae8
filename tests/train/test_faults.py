"""Fault injection into the trainer: NaN and huge logits, failing and constant rewards, a reference
that changes under the run. Nothing non-finite may reach the weights; bad steps are skipped, counted
and logged with their cause; K bad steps in a row roll back to the last healthy checkpoint.

Faults are injected with forward hooks on the policy's LM head that act only when gradients are on,
i.e. in the update's forward pass (sampling and the no-grad log-prob passes are left intact, so the
batch itself is sound and only the update is poisoned).
"""

import json
from pathlib import Path

import pytest
import torch

from grpokit import rewards
from grpokit.config import load_config
from grpokit.rollout.base import NonFiniteLogits, SamplingParams, sample_next
from grpokit.train import build_trainer
from grpokit.train import checkpoint as ckpt_lib
from grpokit.train.guard import ReferenceDriftError, diagnose
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir

if "test_flaky" not in rewards.REGISTRY:
    @rewards.register("test_flaky")
    def _flaky(prompts, completions, **columns):
        """Fails on every other call (a reward service that times out now and then)."""
        _flaky.calls += 1
        if _flaky.calls % 2 == 0:
            raise RuntimeError("reward service unavailable")
        return [float(sum(ch.isdigit() for ch in c) % 3) for c in completions]
    _flaky.calls = 0

if "test_half_none" not in rewards.REGISTRY:
    @rewards.register("test_half_none")
    def _half_none(prompts, completions, **columns):
        """Every other completion cannot be scored (None: its total reward is NaN)."""
        return [None if i % 2 else float(sum(ch.isdigit() for ch in c) % 3) for i, c in enumerate(completions)]

if "test_constant" not in rewards.REGISTRY:
    @rewards.register("test_constant")
    def _constant(prompts, completions, **columns):
        """The same reward for every completion: every group has zero std."""
        return [1.0] * len(completions)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model_dir = tiny_model_dir(root / "model")
    train, _ = arithmetic_files(root / "data")
    return root, model_dir, train


def _trainer(setup, name: str, health: bool = True, **over):
    root, model_dir, train = setup
    opts = {"rewards": "[{name: test_varied}]", "train.steps": 3, "algorithm.kl.beta": 0.05,
            "algorithm.kl.controller": "fixed", **over}
    return build_trainer(load_config(None, small_overrides(model_dir, train, root / name, **opts)), health=health)


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _poison(tr, bad_steps, fn):
    """Apply `fn` to the LM head's logits in the update's forward pass of the given (1-based) steps."""
    def hook(_module, _inp, out):
        if torch.is_grad_enabled() and tr.step_idx + 1 in bad_steps:
            return fn(out)
        return None
    return tr.model.get_output_embeddings().register_forward_hook(hook)


def _nan(out):
    return out * float("nan")


# ---------------------------------------------------------------------------------------- diagnosis

def test_diagnosis_follows_the_order_cheapest_cause_first():
    nan = float("nan")
    assert "reward" in diagnose(rewards=torch.tensor([1.0, nan]), advantages=torch.tensor([nan]))
    assert "advantages" in diagnose(advantages=torch.tensor([0.0, nan]), ratio_max=float("inf"))
    assert "zero std" in diagnose(advantages=torch.tensor([nan]), frac_zero_std=0.5)
    assert "ratio overflow" in diagnose(ratio_max=float("inf"), logp_finite=False)
    assert "ratio overflow" in diagnose(ratio_max=5e3)
    assert "non-finite log-probs" in diagnose(ratio_max=2.0, logp_finite=False, logp_min=-1e9)
    assert "extreme log-probs" in diagnose(logp_min=-1e9, grad_finite=False)
    assert "gradients" in diagnose(logp_min=-3.0, grad_finite=False)
    assert "not identified" in diagnose(advantages=torch.tensor([1.0]), ratio_max=1.0, logp_min=-3.0)


def test_diagnosis_reports_unscored_rewards_and_zero_std_groups_as_context():
    """With finite advantages, NaN rewards and zero-std groups (both given advantage 0) cannot be the
    cause, but the cause line still says they were there."""
    nan = float("nan")
    line = diagnose(rewards=torch.tensor([1.0, nan, nan]), advantages=torch.tensor([0.0, 0.0, 1.0]),
                    frac_zero_std=0.5, logp_finite=False)
    assert line.startswith("non-finite log-probs")
    assert "2 reward(s) not finite" in line and "50% of groups have zero std" in line
    assert diagnose(rewards=torch.tensor([1.0]), frac_zero_std=0.0, grad_finite=False) == \
        "non-finite gradients (overflow in backward)"
    assert "zero std" not in diagnose(frac_zero_std=nan, grad_finite=False)


# ---------------------------------------------------------------------------------------- skip

def test_nan_logits_never_reach_the_weights_and_the_step_is_counted(setup):
    tr = _trainer(setup, "nan", **{"train.save_every": 1})
    _poison(tr, {2}, _nan)
    seen = {}
    tr.train(progress=lambda step, m: seen.setdefault(step, _weights(tr.model)))
    run = tr.run_dir
    assert torch.equal(seen[2], seen[1])                  # the poisoned update changed nothing
    assert not torch.equal(seen[3], seen[2])              # and training went on
    assert torch.isfinite(seen[3]).all()
    rows = _rows(run, "metrics.jsonl")
    assert [r["guard/skipped_steps"] for r in rows] == [0, 1, 1]
    assert [r["guard/rollbacks"] for r in rows] == [0, 0, 0]
    events = _rows(run, "guard.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("skip", 2)]
    assert "non-finite log-probs" in events[0]["cause"]
    # a checkpoint written after a skipped update is not healthy; the next clean one is
    marks = {p.name: json.loads((p / "COMPLETE").read_text())["healthy"] for p in ckpt_lib.list_checkpoints(run)}
    assert marks == {"step_000002": False, "step_000003": True}
    assert ckpt_lib.healthy_checkpoint(run).name == "step_000003"


def _huge(out):
    return out * 1e30


def _huge_gradient(out):
    """Logits unchanged forward, their gradient scaled by 1e30 backward (an overflow in backward)."""
    return out + (out * 1e30 - (out * 1e30).detach())


@pytest.mark.parametrize("fault, beta, cause", [(_huge, 0.05, "extreme log-probs"), (_huge, 0.0, "extreme log-probs"),
                                                (_huge_gradient, 0.05, "non-finite gradients")])
def test_huge_logits_are_skipped_with_their_cause(setup, fault, beta, cause):
    """Logits scaled by 1e30 stay finite, but the sampled tokens' log-probs reach -1e30: the gradient
    norm overflows (KL to the reference is clamped, so the loss stays finite) and the guard names the
    extreme log-probs, which come before the gradient in the diagnosis order. A gradient that
    overflows on its own is named as such."""
    tr = _trainer(setup, f"huge{fault.__name__}{beta}", **{"algorithm.kl.beta": beta, "train.steps": 2})
    _poison(tr, {2}, fault)
    seen = {}
    tr.train(progress=lambda step, m: seen.setdefault(step, _weights(tr.model)))
    assert torch.equal(seen[2], seen[1])
    events = _rows(tr.run_dir, "guard.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("skip", 2)]
    assert cause in events[0]["cause"]
    m = _rows(tr.run_dir, "metrics.jsonl")[-1]
    assert m["guard/skipped_steps"] == 1


def test_a_reward_that_throws_now_and_then_is_excluded_not_nan(setup):
    """A failing reward scores None: its samples get advantage 0 on that step; nothing is skipped."""
    tr = _trainer(setup, "flaky", **{"rewards": "[{name: test_flaky}]", "train.steps": 4})
    tr.train()
    rows = _rows(tr.run_dir, "metrics.jsonl")
    errors = [r["reward/test_flaky/errors"] for r in rows]
    assert sum(e > 0 for e in errors) == 2 and sum(e == 0 for e in errors) == 2
    for r in rows:
        assert r["guard/skipped_steps"] == 0
        if r["reward/test_flaky/errors"]:
            assert r["advantage/std"] == 0.0 and r["group/frac_zero_std"] == 1.0
        else:
            assert r["advantage/std"] > 0
    assert torch.isfinite(_weights(tr.model)).all()


@pytest.mark.parametrize("adv_eps", [1e-6, 0.0])
def test_zero_std_groups_give_advantage_exactly_zero(setup, adv_eps):
    """Every group with equal rewards: advantage exactly 0 (no 0/0 even with adv_eps = 0), no skip."""
    tr = _trainer(setup, f"flat{adv_eps}", **{"rewards": "[{name: test_constant}]", "train.steps": 2,
                                              "algorithm.adv_eps": adv_eps})
    tr.train()
    adv = tr.last_batch.advantages
    assert torch.equal(adv, torch.zeros_like(adv))
    rows = _rows(tr.run_dir, "metrics.jsonl")
    assert all(r["group/frac_zero_std"] == 1.0 and r["guard/skipped_steps"] == 0 for r in rows)
    assert all(torch.isfinite(torch.tensor(r["loss/total"])) for r in rows)
    assert not (tr.run_dir / "guard.jsonl").exists()


@pytest.mark.parametrize("reward, seen", [("test_constant", "100% of groups have zero std"),
                                          ("test_half_none", "8 reward(s) not finite")])
def test_a_skipped_step_names_the_zero_std_groups_and_unscored_rewards(setup, reward, seen):
    """The logged cause follows the whole diagnosis order: it names the NaN logits and also what
    the first two checks (rewards, zero-std groups) found in the step."""
    tr = _trainer(setup, f"context_{reward}", **{"rewards": f"[{{name: {reward}}}]", "train.steps": 2})
    _poison(tr, {2}, _nan)
    tr.train()
    [event] = _rows(tr.run_dir, "guard.jsonl")
    assert event["step"] == 2 and "non-finite log-probs" in event["cause"] and seen in event["cause"]


def test_a_nan_in_one_mini_batch_skips_only_that_update(setup):
    """mini_batches = 2 and a NaN in the first one of step 2: its update is skipped, the second is
    applied. The step is bad (logged) but not counted as a skipped step."""
    tr = _trainer(setup, "minibatch", **{"algorithm.mini_batches": 2, "train.steps": 3})
    calls = []

    def first_forward_only(out):
        calls.append(1)
        return _nan(out) if len(calls) == 1 else None
    _poison(tr, {2}, first_forward_only)
    seen = {}
    tr.train(progress=lambda step, m: seen.setdefault(step, _weights(tr.model)))
    assert not torch.equal(seen[2], seen[1]) and torch.isfinite(seen[2]).all()   # the other half applied
    rows = _rows(tr.run_dir, "metrics.jsonl")
    assert [r["guard/skipped_steps"] for r in rows] == [0, 0, 0]
    assert [r["guard/skipped_minibatches"] for r in rows] == [0, 1, 1]
    [event] = _rows(tr.run_dir, "guard.jsonl")
    assert (event["step"], event["updates_skipped"], event["updates"]) == (2, 1, 2)
    assert "non-finite log-probs" in event["cause"]


def test_non_finite_logits_raise_a_specific_error_when_sampling():
    params = SamplingParams(temperature=1.0)
    ok = torch.tensor([[0.0, float("-inf"), 1.0]])        # a masked token is fine
    assert sample_next(ok, params, torch.Generator().manual_seed(0))[0].item() in (0, 2)
    for bad in ([[0.0, float("nan"), 1.0]], [[0.0, float("inf"), 1.0]], [[float("-inf")] * 3]):
        for temperature in (1.0, 0.0):
            with pytest.raises(NonFiniteLogits, match="non-finite logits during sampling: 1 of 2 rows"):
                sample_next(torch.tensor([[0.0, 0.0, 0.0], *bad]), SamplingParams(temperature=temperature))
    assert issubclass(NonFiniteLogits, ValueError)


def test_nan_weights_during_sampling_are_skipped_then_rolled_back(setup):
    """The weights turn NaN after step 1 (a bug writes into them): the rollouts of steps 2 and 3 meet
    NaN logits; both steps are skipped, and with K = 2 step 3 rolls back to step 1's healthy
    checkpoint; step 4 trains normally from there."""
    tr = _trainer(setup, "nan_sampling", **{"train.save_every": 1, "train.steps": 4, "guard.max_consecutive_bad": 2})
    seen = {}

    def progress(step, m):
        seen[step] = _weights(tr.model)
        if step == 1:
            with torch.no_grad():
                tr.model.get_output_embeddings().weight.fill_(float("nan"))
    tr.train(progress=progress)
    events = _rows(tr.run_dir, "guard.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("skip", 2), ("skip", 3), ("rollback", 3)]
    assert all(e["cause"].startswith("non-finite logits during sampling") for e in events)
    assert events[-1]["to"] == "step_000001"
    assert torch.equal(seen[3], seen[1])                   # the healthy weights are back
    assert torch.isfinite(seen[4]).all() and not torch.equal(seen[4], seen[3])
    rows = _rows(tr.run_dir, "metrics.jsonl")
    assert [r["guard/skipped_steps"] for r in rows] == [0, 1, 2, 2]
    assert [r["guard/skipped_minibatches"] for r in rows] == [0, 1, 2, 2]
    assert [r["guard/rollbacks"] for r in rows] == [0, 0, 1, 1]
    assert "reward/mean" not in rows[1] and "reward/mean" in rows[3]


# ---------------------------------------------------------------------------------------- rollback

def test_k_bad_steps_in_a_row_roll_back_to_the_last_healthy_checkpoint(setup):
    """NaN in steps 3-5 with K = 3: step 5 rolls back to step 2 (the last healthy checkpoint, kept
    although keep_last = 1), halves the learning rate and training carries on. The weights are
    damaged by hand after step 4 so that the rollback has something to undo."""
    lr = 1e-3
    tr = _trainer(setup, "rollback", **{"train.save_every": 1, "train.keep_last": 1, "train.steps": 6,
                                        "guard.max_consecutive_bad": 3, "guard.rollback_lr_factor": 0.5,
                                        "optim.lr": lr})
    _poison(tr, {3, 4, 5}, _nan)
    ckdir = tr.run_dir / "checkpoints"
    kept, after, adam = {}, {}, {}

    def progress(step, m):
        kept[step] = sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step_"))
        after[step] = _weights(tr.model)
        adam[step] = tr.worker.optimizer.state_dict()["state"][0]["exp_avg"].clone()
        if step == 4:
            with torch.no_grad():
                for p in tr.model.parameters():
                    p.add_(0.5)
    tr.train(progress=progress)

    assert kept[3] == ["step_000002", "step_000003"]      # healthy step 2 kept beside the last one
    assert kept[4] == ["step_000002", "step_000004"]
    events = _rows(tr.run_dir, "guard.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("skip", 3), ("skip", 4), ("skip", 5), ("rollback", 5)]
    assert events[-1]["to"] == "step_000002" and "non-finite log-probs" in events[-1]["cause"]
    assert torch.equal(after[5], after[2])                # the step-2 weights are back
    assert torch.equal(adam[5], adam[2])                  # and its optimizer state
    assert not torch.equal(after[6], after[5])            # and training goes on from them
    rows = _rows(tr.run_dir, "metrics.jsonl")
    assert [r["guard/skipped_steps"] for r in rows] == [0, 0, 1, 2, 3, 3]
    assert [r["guard/rollbacks"] for r in rows] == [0, 0, 0, 0, 1, 1]
    assert rows[5]["optim/lr"] == pytest.approx(lr * 0.5)
    assert rows[1]["optim/lr"] == pytest.approx(lr)
    # after the rollback the weights are healthy again: step 6's checkpoint is the new healthy one
    assert ckpt_lib.healthy_checkpoint(tr.run_dir).name == "step_000006"
    state = ckpt_lib.load_state(tr.run_dir / "checkpoints" / "step_000006")
    assert state["rollbacks"] == 1 and state["skipped_steps"] == 3


@pytest.mark.parametrize("save_every, why", [(1, "2 rollbacks already"), (0, "no healthy checkpoint")])
def test_a_run_that_keeps_failing_stops_with_an_error(setup, save_every, why):
    tr = _trainer(setup, f"diverge{save_every}", health=False,
                  **{"train.save_every": save_every, "train.save_every_minutes": 0, "train.steps": 8,
                     "guard.max_consecutive_bad": 1,
                     "guard.max_rollbacks": 2})
    _poison(tr, set(range(2, 9)), _nan)
    with pytest.raises(RuntimeError, match=f"training diverged .*{why}"):
        tr.train()
    assert tr.guard.rollbacks == (2 if save_every else 0)


def test_a_default_run_checkpoints_step_0_and_rolls_back(setup):
    """No checkpoint setting at all: step 0 is saved before training, so a NaN streak rolls back to
    it instead of stopping with "no healthy checkpoint"."""
    root, model_dir, train = setup
    over = small_overrides(model_dir, train, root / "default_ckpt", **{
        "train.steps": 4, "guard.max_consecutive_bad": 2, "guard.max_rollbacks": 3})
    assert not any(o.startswith("train.save_every") for o in over)        # the defaults decide
    cfg = load_config(None, over)
    assert cfg.train.save_every >= 500 and cfg.train.save_every_minutes > 0
    tr = build_trainer(cfg, health=False)
    _poison(tr, {2, 3}, _nan)
    tr.train()
    events = _rows(tr.run_dir, "guard.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("skip", 2), ("skip", 3), ("rollback", 3)]
    assert events[-1]["to"] == "step_000000"
    names = sorted(p.name for p in (tr.run_dir / "checkpoints").glob("step_*"))
    assert names == ["step_000000", "step_000004"] and tr.guard.rollbacks == 1


def test_time_based_checkpoints_and_kept_healthy_ones(setup):
    """save_every_minutes fires when the clock says so, whatever the step count; keep_healthy keeps
    the newest healthy checkpoints beside the newest ones."""
    tr = _trainer(setup, "timed", health=False, **{"train.save_every": 0, "train.save_every_minutes": 1,
                                                   "train.steps": 5, "train.keep_last": 1, "train.keep_healthy": 2})
    ticks = iter(range(0, 10_000, 40))                       # 40 s per reading of the trainer's clock
    tr.clock = lambda: float(next(ticks))
    tr.train()                                               # saves steps 0, 2, 4 (>= 60 s after the last), 5
    assert sorted(p.name for p in (tr.run_dir / "checkpoints").glob("step_*")) == ["step_000004", "step_000005"]
    names = sorted(p.name for p in (tr.run_dir / "checkpoints").glob("step_*"))
    assert len(names) == 2 and names[-1] == "step_000005"    # keep_last 1 + the previous healthy one
    assert [p.name for p in ckpt_lib.healthy_checkpoints(tr.run_dir)] == names


@pytest.mark.parametrize("only_in_half", [True, False])
def test_mixed_precision_overflow_is_named(setup, only_in_half):
    """A bfloat16 policy whose training forward overflows: when a float32 recomputation of the same
    micro-batch is finite the cause is mixed precision (the third check of the diagnosis order);
    when it overflows in float32 too, it is not."""
    tr = _trainer(setup, f"bf16_{only_in_half}", health=False,
                  **{"model.dtype": "bfloat16", "train.steps": 1, "algorithm.kl.beta": 0.0})

    def hook(_module, _inp, out):      # the training forward only (generation runs in inference mode)
        if not torch.is_inference_mode_enabled() and (out.dtype == torch.bfloat16 or not only_in_half):
            return out * float("inf")
        return None
    tr.model.get_output_embeddings().register_forward_hook(hook)
    tr.train()
    cause = _rows(tr.run_dir, "guard.jsonl")[0]["cause"]
    assert ("mixed precision" in cause and "bfloat16" in cause) == only_in_half, cause


# ---------------------------------------------------------------------------------------- reference

def _corrupt_reference_after(tr, step: int):
    def progress(s, m):
        if s == step:
            with torch.no_grad():
                tr.reference.module.get_output_embeddings().weight.mul_(1.01)   # a bug writes into it
    return progress


def test_a_reference_changed_mid_run_raises_ref_drift(setup):
    tr = _trainer(setup, "refdrift", **{"train.steps": 5, "guard.ref_check_every": 2})
    tr.train(progress=_corrupt_reference_after(tr, 2))
    rows = _rows(tr.run_dir, "metrics.jsonl")
    drift = {r["step"]: r.get("ref/integrity_drift") for r in rows}
    assert drift[1] == 0.0 and drift[2] == 0.0            # recorded at step 1, checked every 2 steps
    assert drift[3] is None and drift[5] is None
    assert drift[4] > 1e-3
    alarms = _rows(tr.run_dir, "alarms.jsonl")
    assert [(a["name"], a["step"]) for a in alarms if a["name"] == "ref_drift"] == [("ref_drift", 4)]
    assert "ref_drift" in tr.health.summary()


def test_strict_reference_check_raises(setup):
    tr = _trainer(setup, "refstrict", health=False, **{"train.steps": 3, "guard.ref_check_every": 1,
                                                        "guard.ref_strict": True})
    with pytest.raises(ReferenceDriftError, match="drifted"):
        tr.train(progress=_corrupt_reference_after(tr, 1))
    assert tr.step_idx == 1


def test_a_frozen_reference_shows_no_drift_even_with_reference_dropout(setup):
    tr = _trainer(setup, "refok", **{"train.steps": 3, "guard.ref_check_every": 1,
                                     "algorithm.kl.ref_dropout": 0.2})
    tr.train()
    rows = _rows(tr.run_dir, "metrics.jsonl")
    assert [r["ref/integrity_drift"] for r in rows] == [0.0, 0.0, 0.0]
    assert not any(a["name"] == "ref_drift" for a in _rows(tr.run_dir, "alarms.jsonl"))
