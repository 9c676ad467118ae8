"""KL kept on a default run: the warm-up then the adaptive band (beta's path recomputed from the
logged per-completion KL), the controller fed the per-completion KL it documents, the variants'
presets with beta > 0 beside their papers' exact settings, and KL still measured at beta = 0."""

import json
import logging

import pytest
import torch

from grpokit.algo import kl as kl_lib
from grpokit.algo.control import FixedKL, register_controller
from grpokit.config import load_config
from grpokit.models import load_model
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("klkept"))


def _run(setup, name, steps, *extra, progress=None):
    root, model_dir, train, _ = setup
    over = small_overrides(model_dir, train, root / name, **{
        "optim.lr": 1e-2, "rewards": "[{name: test_varied}]", "train.steps": steps,
        "rollout.max_new_tokens": 6})
    torch.manual_seed(0)
    tr = build_trainer(load_config(None, over + list(extra)), health=False)
    tr.train(progress=progress)
    return tr, [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines() if '"kl/beta"' in x]


def test_beta_on_a_default_run_is_held_through_the_warmup_then_follows_the_band(setup, caplog):
    caplog.set_level(logging.INFO, logger="grpokit.train")
    tr, rows = _run(setup, "default", 30)
    betas = [r["kl/beta"] for r in rows]
    assert betas[:3] == pytest.approx([0.08] * 3)               # a tenth of 30 steps at 4 x 0.02
    beta = 0.02                                                 # then the band, from 0.02, recomputed
    for r, logged in zip(rows[3:], betas[3:]):
        assert logged == pytest.approx(beta)
        kl = r["kl/ref_seq"]
        beta = beta * 1.05 if kl > 10.0 else beta / 1.05 if kl < 1.0 else beta
        beta = min(max(beta, 1e-6), 10.0)
    assert "step 3: the KL warm-up ends (beta 0.08 held for 3 steps); the adaptive controller takes over" in caplog.text


class SpyKL(FixedKL):
    """A fixed beta that records what the trainer feeds it."""
    kind = "test_spy"
    seen: list = []

    def step(self, observed_kl):
        SpyKL.seen.append(observed_kl)
        return super().step(observed_kl)


register_controller("test_spy", SpyKL, overwrite=True)


@pytest.mark.parametrize("unit, key", [("sequence", "kl/ref_seq"), ("token", "kl/ref")])
def test_the_trainer_feeds_the_controller_the_kl_of_its_unit(setup, unit, key):
    """Per completion (the default unit: the band's 1-10 nats) or per token, as configured: the
    value the controller gets is the step's logged KL in that unit, and the two differ here
    (completions of several tokens), so feeding the wrong one shows."""
    SpyKL.seen = []
    _, rows = _run(setup, f"spy_{unit}", 4, "algorithm.kl.controller=test_spy", f"algorithm.kl.target_unit={unit}",
                   "algorithm.kl.target_low=0", "algorithm.kl.target_high=100")
    assert SpyKL.seen == pytest.approx([r[key] for r in rows], rel=1e-12)
    assert all(r["kl/ref_seq"] > 1.5 * r["kl/ref"] > 0 for r in rows[1:])


def test_the_variants_keep_kl_and_their_papers_settings_stay_available():
    from grpokit.config.kl_control import build_kl_controller

    for name in ("dapo", "dapo_wide_clip", "dapo_resample", "dr_grpo", "dr_grpo_rewrite", "gspo", "grpo"):
        cfg = load_config([name])
        assert cfg.algorithm.kl.beta == 0.02 and cfg.algorithm.kl.controller == "adaptive", name
        assert build_kl_controller(cfg).beta == pytest.approx(0.08)          # the warm-up first
    for name, variant in (("dapo_paper", "dapo"), ("dr_grpo_paper", "dr_grpo"), ("gspo_paper", "gspo")):
        paper, kept = load_config([name]), load_config([variant])
        assert paper.algorithm.kl.beta == 0
        kept.algorithm.kl.beta = 0.0                             # otherwise the same settings
        assert paper.model_dump() == kept.model_dump()


def test_with_beta_zero_kl_is_still_measured_on_a_sample_every_n_steps(setup):
    """beta = 0: no KL term, but every `measure_every` steps the KL of the step's first
    `measure_rows` completions is measured before the update; recomputed here from the weights
    as they were (a snapshot after the previous step) and the frozen reference, token by token."""
    root, model_dir, _, _ = setup
    snaps = {}
    seen_batches = {}

    def keep(step, m):
        snaps[step] = {k: v.detach().clone() for k, v in tr_ref[0].model.state_dict().items()}
        seen_batches[step] = tr_ref[0].last_batch

    tr_ref = [None]
    root_, model_dir_, train, _ = setup
    over = small_overrides(model_dir, train, root / "beta0", **{
        "optim.lr": 1e-2, "rewards": "[{name: test_varied}]", "train.steps": 5, "rollout.max_new_tokens": 6,
        "algorithm.kl.beta": 0.0, "algorithm.kl.measure_every": 2, "algorithm.kl.measure_rows": 5})
    torch.manual_seed(0)
    tr = tr_ref[0] = build_trainer(load_config(None, over), health=False)
    assert tr.reference is not None
    tr.train(progress=keep)
    rows = [json.loads(x) for x in (root / "beta0" / "metrics.jsonl").read_text().splitlines()]
    measured = [r["step"] for r in rows if "kl/ref" in r]
    assert measured == [1, 3, 5] and all(r["kl/measured_rows"] == 5 for r in rows if "kl/ref" in r)
    assert rows[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)           # step 1: the policy is the reference
    # step 5, recomputed: the policy before step 5's update is the one saved after step 4
    batch = seen_batches[5]
    policy = load_model(model_dir, dtype="float32", device="cpu")
    policy.load_state_dict(snaps[4])
    reference = load_model(model_dir, dtype="float32", device="cpu")
    temp = tr.cfg.rollout.temperature
    rows5 = [i for i in range(len(batch)) if batch.action_mask[i].any()][:5]
    tok_sum, n_tok, seq = 0.0, 0, []
    with torch.no_grad():
        for i in rows5:
            p = batch.prompt_ids[i]
            c = batch.completion_ids[i][batch.mask[i].bool()]
            ids = torch.cat([torch.as_tensor(p), c]).unsqueeze(0)
            lp = [torch.log_softmax(m(ids).logits[0, len(p) - 1:-1].float() / temp, -1).gather(-1, c[:, None])[:, 0]
                  for m in (policy, reference)]
            act = batch.action_mask[i][batch.mask[i].bool()].float()
            k = kl_lib.estimate(lp[0], lp[1], "k3") * act
            tok_sum, n_tok = tok_sum + float(k.sum()), n_tok + int(act.sum())
            seq.append(float(k.sum()))
    got = next(r for r in rows if r["step"] == 5)
    assert got["kl/ref"] > 0
    assert got["kl/ref"] == pytest.approx(tok_sum / n_tok, rel=1e-4)
    assert got["kl/ref_seq"] == pytest.approx(sum(seq) / len(seq), rel=1e-4)


def test_beta_zero_without_measuring_keeps_no_reference(setup):
    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "noref", **{
        "algorithm.kl.beta": 0.0, "algorithm.kl.measure_every": 0}))
    assert build_trainer(cfg, health=False).reference is None
