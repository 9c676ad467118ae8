"""An engine that holds its own weights (`rollout.engine: hf_copy`): after a step and a sync it
samples exactly as the trained policy does; pi_old is recomputed and the mismatch logged."""

import pytest
import torch

from grpokit.config import load_config
from grpokit.rollout.hf import HFEngine
from tests.fixtures import greedy_outputs, small_overrides, tiny_run_inputs, varied_trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("sync"))


def _trainer(setup, name, **extra):
    return varied_trainer(setup, name, **{"rollout.engine": "hf_copy", **extra})


@pytest.mark.parametrize("lora", [False, True])
def test_engine_with_its_own_weights_matches_the_trained_policy_after_sync(setup, lora):
    extra = {"lora.enabled": True, "lora.rank": 4} if lora else {}
    tr = _trainer(setup, f"sync_lora{lora}", **extra)
    assert tr.engine.owns_weights and tr.engine.model is not tr.model
    assert not any(p.data_ptr() == q.data_ptr() for p in tr.engine.model.parameters() for q in tr.model.parameters())
    m = tr.step()
    assert m["optim/grad_norm"] > 0
    # the step pushed its weights: greedy tokens and sampler log-probs equal the trained policy's
    policy_engine = HFEngine(tr.model, tr.tokenizer)
    tok_e, lp_e = greedy_outputs(tr.engine, tr)
    tok_p, lp_p = greedy_outputs(policy_engine, tr)
    assert torch.equal(tok_e, tok_p)
    torch.testing.assert_close(lp_e, lp_p, atol=1e-5, rtol=0)
    assert tr.engine.weights_version == 1
    # pi_old was recomputed by the trainer and the sampler/trainer mismatch logged (same numerics here)
    assert 0.0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"] < 1e-3
    assert m["rollout/is_clip_frac"] == 0.0 and m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_without_the_sync_the_engine_falls_behind(setup, monkeypatch):
    tr = _trainer(setup, "nosync")
    from grpokit.train import step as step_mod

    monkeypatch.setattr(step_mod, "sync_weights", lambda *a, **k: None)     # the step pushes nothing
    before = greedy_outputs(tr.engine, tr)[1]
    tr.step()
    stale, fresh = greedy_outputs(tr.engine, tr)[1], greedy_outputs(HFEngine(tr.model, tr.tokenizer), tr)[1]
    assert torch.equal(stale, before)                                  # the engine's copy never moved
    assert float((stale - fresh).abs().max()) > 1e-4                   # while the policy did


def test_update_weights_refuses_a_wrong_name_or_shape(setup):
    tr = _trainer(setup, "refuse")
    named = dict(tr.worker.export_weights())
    name = next(iter(named))
    with pytest.raises(KeyError, match="no tensor"):
        tr.engine.update_weights([("not.a.weight", named[name])])
    with pytest.raises(ValueError, match="shape"):
        tr.engine.update_weights([(name, named[name][:1])])
    before = {n: t.clone() for n, t in tr.engine.model.state_dict().items()}
    changed = [(n, t + 1.0) for n, t in named.items()]
    with pytest.raises(ValueError, match="shape"):                     # the last tensor is wrong ...
        tr.engine.update_weights(changed[:-1] + [(changed[-1][0], changed[-1][1][:1])])
    after = tr.engine.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)       # ... and nothing was loaded
    with pytest.raises(ValueError, match="not sent"):
        tr.engine.update_weights([(name, named[name])])


def test_unknown_engine_is_a_config_error(setup):
    root, model_dir, train, _ = setup
    with pytest.raises(Exception, match="engine"):
        load_config(None, small_overrides(model_dir, train, root / "bad", **{"rollout.engine": "vlm"}))


def test_the_driver_frees_and_restores_engine_memory_around_each_rollout(setup):
    """`resume_memory` before generating, `release_memory` after: in that order, once per step; an
    engine without them (only `generate`) works too."""
    tr = _trainer(setup, "memory", **{"rollout.engine": "hf", "train.steps": 1})
    calls = []

    class Spy:
        owns_weights = False

        def __init__(self, inner):
            self.inner = inner

        def generate(self, *a, **k):
            calls.append("generate")
            return self.inner.generate(*a, **k)

        def release_memory(self):
            calls.append("release")

        def resume_memory(self):
            calls.append("resume")

    tr.collector.engine = Spy(tr.engine)              # the collector owns the engine
    tr.step()
    assert calls == ["resume", "generate", "release"]

    class Bare:
        def __init__(self, inner):
            self.generate = inner.generate

    tr.collector.engine = Bare(tr.engine.inner)
    assert tr.step()["optim/grad_norm"] >= 0
