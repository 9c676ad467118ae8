"""The variant switches at the trainer level: dynamic sampling, reference dropout, rewriting's loss,
and every preset end to end."""

import pytest
import torch

from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.rewards import REGISTRY, register
from grpokit.train import build_trainer
from grpokit.train.dropout import hidden_dropout
from grpokit.train.logprobs import build_micro_batch, completion_logprobs
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir

PRESETS = ["grpo", "dr_grpo", "dr_grpo_seed", "dr_grpo_rewrite", "dapo", "dapo_wide_clip", "dapo_resample", "reinforce",
           "reinforce_sign", "grpo_buckets", "gspo", "kl_warmup"]   # `code`: tests/train/test_code_preset.py

if "test_one_group_varies" not in REGISTRY:
    @register("test_one_group_varies")
    def _one_group_varies(prompts, completions, **columns):
        """Varied rewards only for prompts whose first operand is even: the other groups are
        all-equal and dynamic sampling must drop them."""
        return [float(i % 2) if int(p.split("+")[0]) % 2 == 0 else 1.0 for i, p in enumerate(prompts)]


if "test_every_group_varies" not in REGISTRY:
    @register("test_every_group_varies")
    def _every_group_varies(prompts, completions, **columns):
        """A shaping term that differs inside every group."""
        return [float(i % 4) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return root, tiny_model_dir(root / "model"), arithmetic_files(root / "data")[0]


def test_dynamic_sampling_refills_and_stops_at_the_round_limit(setup):
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "dyn", **{
        "rollout.dynamic_sampling": True, "rollout.max_sampling_rounds": 6,
        "rewards": "[{name: test_one_group_varies}]"}))
    tr = build_trainer(cfg, health=False)
    batch, info = tr.collect()
    idx = [int(batch.prompt_index[rows[0]]) for rows in batch.group_rows()]
    assert len(idx) == cfg.prompts_per_step == 4 and len(batch) == 16
    assert all(int(tr.dataset[i]["prompt"].split("+")[0]) % 2 == 0 for i in idx)   # only varied groups kept
    assert len(set(batch.group_id.tolist())) == 4 and len(set(batch.uid)) == 16    # ids stay distinct across rounds
    assert 1 <= info["dynamic/rounds"] <= 6
    # a reward with no variance at all: every round is spent, the last batch is used as is
    cfg = load_config(None, small_overrides(model_dir, train, root / "dyn2", **{
        "rollout.dynamic_sampling": True, "rollout.max_sampling_rounds": 3, "rewards": "[{name: exact_match}]"}))
    tr = build_trainer(cfg, health=False)
    tr.sampler.next(0)
    batch, info = tr.collect()
    assert info["dynamic/rounds"] == 3 and info["dynamic/kept_groups"] == 0 and len(batch) == 16


@pytest.mark.parametrize("on", ["reward", "pass"])
def test_dynamic_sampling_on_the_total_reward_or_on_passing(setup, on):
    """A shaping term that varies in every group keeps every group when the total reward decides;
    on `pass` (DAPO's Eq. 11) only the groups with right and wrong answers by the first reward stay."""
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / f"dyn-{on}", **{
        "rollout.dynamic_sampling": True, "rollout.max_sampling_rounds": 8, "rollout.dynamic_sampling_on": on,
        "algorithm.pass_threshold": 1.0,
        "rewards": "[{name: test_one_group_varies}, {name: test_every_group_varies, weight: 0.1}]"}))
    tr = build_trainer(cfg, health=False)
    batch, info = tr.collect()
    even = [int(tr.dataset[int(batch.prompt_index[rows[0]])]["prompt"].split("+")[0]) % 2 == 0
            for rows in batch.group_rows()]
    assert len(even) == 4
    if on == "pass":
        assert all(even)
    else:
        assert info["dynamic/rounds"] == 1                     # the first round's groups all vary
    with pytest.raises(ConfigError, match="dynamic_sampling_on"):
        load_config(None, small_overrides(model_dir, train, root / "dyn-bad", **{"rollout.dynamic_sampling_on": "loss"}))


def test_reference_dropout_changes_reference_logprobs_only_while_active(setup):
    root, model_dir, train = setup
    tr = build_trainer(load_config(None, small_overrides(model_dir, train, root / "refdrop")), health=False)
    tok = tr.tokenizer
    ids = torch.tensor([tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
    mb = build_micro_batch([0], [tok("3+9=")["input_ids"]], ids, torch.ones_like(ids), tok.pad_token_id)
    with torch.no_grad():
        ref = tr.reference.module
        base = completion_logprobs(ref, mb)[0]
        with hidden_dropout(ref, 0.5):
            dropped = completion_logprobs(ref, mb)[0]
        after = completion_logprobs(ref, mb)[0]
    assert not torch.allclose(base, dropped)
    torch.testing.assert_close(base, after)


def test_rewriting_adds_a_likelihood_term(setup):
    root, model_dir, train = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "rewrite", **{
        "algorithm.rewrite.enabled": True, "algorithm.rewrite.template": " no: {answer}",
        "algorithm.rewrite.weight": 0.5, "rewards": "[{name: exact_match}]"}))
    tr = build_trainer(cfg, health=False)
    m = tr.step()
    assert m["loss/rewrite"] > 0                     # NLL of the notes, weighted
    assert m["optim/grad_norm"] > 0                  # all-wrong groups: only the rewrite term moves weights


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_and_moves_the_weights(setup, preset):
    root, model_dir, train = setup
    over = small_overrides(model_dir, train, root / f"preset-{preset}", **{
        "rewards": "[{name: test_varied}]", "train.steps": 3, "rollout.max_new_tokens": 6})
    tr = build_trainer(load_config(["demo", preset], over), health=False)
    before = torch.cat([p.detach().flatten().clone() for p in tr.model.parameters()])
    last = tr.train()
    after = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    assert torch.isfinite(torch.tensor(last["loss/total"]))
    assert not torch.equal(before, after)
