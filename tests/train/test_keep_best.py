"""`train.keep_best`: a run ends with the policy of its best validation score, written to
RUN_DIR/best/, while its checkpoints keep the last policy."""

import json

import pytest
import torch

from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.train import build_trainer
from grpokit.train import run as run_mod
from grpokit.train.checkpoint import load_weights
from tests.fixtures import small_overrides, tiny_run_inputs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("keepbest"))


def _trainer(setup, run, **over):
    _, model_dir, train, held = setup
    opts = {"rewards": "[{name: test_varied}]", "optim.lr": 1e-2, "data.eval_path": held, "data.eval_size": 4,
            "train.keep_best": True, "train.eval_every": 1, "train.save_every": 1, "train.keep_last": 10,
            "train.batch_advice": False, **over}
    torch.manual_seed(0)
    return build_trainer(load_config(None, small_overrides(model_dir, train, run, **opts)), health=False)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _scripted(monkeypatch, scores):
    """The evaluation returns `scores` in turn (the evaluation itself is tested elsewhere; here the
    choice and the restore are)."""
    it = iter(scores)
    monkeypatch.setattr(run_mod, "held_out", lambda *a, **k: {"eval/pass@1": next(it)})


def test_the_run_ends_with_the_best_policy_and_checkpoints_keep_the_last(setup, monkeypatch):
    run = setup[0] / "scripted"
    _scripted(monkeypatch, [0.2, 0.5, 0.5, 0.25, 0.1])     # steps 0-4: the tie goes to step 2
    t = _trainer(setup, run, **{"train.steps": 4})
    t.train()
    assert t.best == {"step": 2, "score": 0.5}
    assert json.loads((run / "best" / "best.json").read_text()) == {"step": 2, "score": 0.5}
    assert [(r["step"], r["eval/pass@1"]) for r in _rows(run) if "eval/pass@1" in r] == \
        [(0, 0.2), (1, 0.5), (2, 0.5), (3, 0.25), (4, 0.1)]

    final = _params(t.model)
    ref = _trainer(setup, setup[0] / "probe", **{"train.keep_best": False, "data.eval_path": ""})
    for step, want in ((2, True), (4, False), (1, False)):
        load_weights(ref.model, run / "checkpoints" / f"step_{step:06d}")
        assert _same(final, _params(ref.model)) is want, step
    load_weights(ref.model, run / "best")
    assert _same(final, _params(ref.model))
    assert (run / "best" / "config.json").is_file() and (run / "best" / "tokenizer_config.json").is_file()


def test_the_base_policy_wins_when_training_only_made_it_worse(setup, monkeypatch):
    run = setup[0] / "worse"
    _scripted(monkeypatch, [0.6, 0.1, 0.0])
    t = _trainer(setup, run, **{"train.steps": 2})
    base = _params(t.model)
    t.train()
    assert t.best["step"] == 0 and _same(base, _params(t.model))


def test_a_failed_evaluation_is_never_the_best(setup, monkeypatch):
    run = setup[0] / "nan"
    _scripted(monkeypatch, [0.1, float("nan"), 0.05])
    t = _trainer(setup, run, **{"train.steps": 2})
    t.train()
    assert t.best == {"step": 0, "score": 0.1}


def test_the_time_budget_s_last_step_is_evaluated_as_a_candidate(setup):
    """A run stopped by `train.max_minutes` evaluates its last policy too (the real evaluation)."""
    run = setup[0] / "budget"
    t = _trainer(setup, run, **{"train.steps": 50, "train.eval_every": 10, "train.max_minutes": 1e-6})
    t.train()
    evals = [(r["step"], r["eval/pass@1"]) for r in _rows(run) if "eval/pass@1" in r]
    assert [s for s, _ in evals] == [0, 1]
    best = max(evals, key=lambda e: (e[1], e[0]))
    assert t.best == {"step": best[0], "score": best[1]}


def test_resume_carries_the_best_policy_on(setup, monkeypatch):
    run = setup[0] / "resume"
    _scripted(monkeypatch, [0.1, 0.7, 0.2])
    _trainer(setup, run, **{"train.steps": 2}).train()
    _scripted(monkeypatch, [0.3, 0.4])
    t = _trainer(setup, run, **{"train.steps": 4})
    t.train(resume=True)
    assert t.best == {"step": 1, "score": 0.7}
    assert json.loads((run / "best" / "best.json").read_text())["step"] == 1


def test_keep_best_without_a_split_to_choose_by_is_refused(setup):
    _, model_dir, train, _ = setup
    with pytest.raises(ConfigError, match="eval_every"):
        load_config(None, small_overrides(model_dir, train, setup[0] / "x", **{"train.keep_best": True,
                                                                              "train.eval_every": 0}))
    with pytest.raises(ConfigError, match="data.eval_path"):
        _trainer(setup, setup[0] / "y", **{"data.eval_path": ""})


@pytest.mark.parametrize("save", ["adapter", "merged"])
def test_a_lora_policy_is_kept_and_restored_in_either_save_form(setup, monkeypatch, save):
    run = setup[0] / f"lora_{save}"
    _scripted(monkeypatch, [0.1, 0.6, 0.2, 0.3])
    t = _trainer(setup, run, **{"train.steps": 3, "lora.enabled": True, "lora.rank": 4, "lora.alpha": 8,
                                "lora.save": save})
    t.train()
    assert t.best == {"step": 1, "score": 0.6}
    final = _params(t.model)
    load_weights(t.model, run / "checkpoints" / "step_000003")
    assert not _same(final, _params(t.model))
    load_weights(t.model, run / "checkpoints" / "step_000001")
    assert _same(final, _params(t.model))
