"""The variant switches at the trainer level: dynamic sampling, reference dropout, rewriting's loss,
and every preset end to end."""

import math

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
    assert info["dynamic/kept_groups"] == 0 and len(batch) == 16 and len(batch.groups) == 4
    assert info["dynamic/sampled_groups"] == 12 and info["dynamic/rounds"] == 2   # keep_rate: 4, then the other 8
    fixed = build_trainer(load_config(None, small_overrides(model_dir, train, root / "dyn3", **{
        "rollout.dynamic_sampling": True, "rollout.max_sampling_rounds": 3, "rollout.dynamic_width": "fixed",
        "rewards": "[{name: exact_match}]"})), health=False)
    batch, info = fixed.collect()
    assert info["dynamic/rounds"] == 3 and info["dynamic/sampled_groups"] == 12 and len(batch) == 16


def test_keep_rate_widths_follow_the_measured_share():
    """The round width: the fewest prompts that keep every missing group with the asked probability
    at the measured rate (checked against the binomial tail summed directly), at least the groups
    missing, at most the prompts left; the rate starts at 1 and each step's counts weigh half the
    next's."""
    from grpokit.train.collect import KeepRate, keep_probability

    def tail(n, k, p):                                                  # P(Binomial(n, p) >= k), summed upward
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))

    for n, k, p in ((10, 2, 1 / 3), (11, 2, 1 / 3), (24, 8, 0.35), (40, 17, 0.5), (3, 4, 0.9)):
        assert keep_probability(n, k, p) == pytest.approx(tail(n, k, p), abs=1e-12)
    k = KeepRate()
    assert k.rate == 1.0 and k.width(8, 24, 0.9) == 8                  # every group kept so far
    k.add(found=2, sampled=8)                                          # (2 + 1) / (8 + 1) = 1/3
    assert k.rate == pytest.approx(1 / 3)
    assert k.width(2, 16, 0.9) == 11                                    # tail(10) = 0.896, tail(11) = 0.925
    assert tail(11, 2, 1 / 3) >= 0.9 > tail(10, 2, 1 / 3)
    assert k.width(6, 16, 0.9) == 16                                    # tail(16, 6, 1/3) = 0.45: all that is left
    assert k.width(2, 16, 0.5) < k.width(2, 16, 0.9) < k.width(2, 16, 0.99)
    k.new_step()                                                        # (1 + 1) / (4 + 1)
    assert k.rate == pytest.approx(0.4)
    n = k.width(8, 48, 0.9)
    assert tail(n, 8, 0.4) >= 0.9 > tail(n - 1, 8, 0.4)
    assert KeepRate(found=99, sampled=99).width(3, 10, 0.9) == 3       # never fewer than missing ...
    assert KeepRate().width(5, 3, 0.9) == 3 and KeepRate().width(5, 0, 0.9) == 0   # ... nor more than left


def test_keep_rate_rounds_keep_the_groups_of_fixed_rounds_in_fewer_rounds(setup):
    """Half the prompts give groups worth keeping. Rounds sized by the keep rate fill each step with
    varied groups as fixed rounds do, in fewer rounds once the rate is measured, each step's width
    the one recomputed here from the logged counts; a resumed collector draws what the
    uninterrupted one draws (the rate is in its state)."""
    root, model_dir, train = setup

    def trainer(name, width):
        return build_trainer(load_config(None, small_overrides(model_dir, train, root / name, **{
            "rollout.dynamic_sampling": True, "rollout.max_sampling_rounds": 4, "rollout.dynamic_width": width,
            "rewards": "[{name: test_one_group_varies}]"})), health=False)

    logs = {}
    for width in ("keep_rate", "fixed"):
        tr = trainer(f"rate-{width}", width)
        logs[width] = []
        for _ in range(4):
            batch, info = tr.collect()
            even = [int(tr.dataset[int(batch.prompt_index[rows[0]])]["prompt"].split("+")[0]) % 2 == 0
                    for rows in batch.group_rows()]
            assert info["dynamic/kept_groups"] == 4 and len(even) == 4 and all(even)
            logs[width].append(info)
    from grpokit.train.collect import KeepRate

    rate, fixed = logs["keep_rate"], logs["fixed"]
    assert sum(i["dynamic/rounds"] for i in rate[1:]) < sum(i["dynamic/rounds"] for i in fixed[1:])
    assert all(i["dynamic/sampled_groups"] <= 16 for i in rate)
    f = s = 0.0                                          # the rate each step was sized by, recomputed
    for info in rate:
        f, s = 0.5 * f, 0.5 * s
        assert info["dynamic/keep_rate"] == pytest.approx((f + 1) / (s + 1))
        first = KeepRate(found=f, sampled=s).width(4, 16, 0.9)          # the first round's width
        f += info["dynamic/kept_groups"] + info["dynamic/surplus_groups"]
        s += info["dynamic/sampled_groups"]
        if info["dynamic/rounds"] == 1:
            assert info["dynamic/sampled_groups"] == first
        else:
            assert info["dynamic/sampled_groups"] > first

    a = trainer("resume-a", "keep_rate")
    a.collect()
    state = a.step_fn.collector.state_dict()
    b = trainer("resume-b", "keep_rate")
    b.step_fn.collector.load_state_dict(state)
    want, got = a.collect(), b.collect()
    assert torch.equal(got[0].completion_ids, want[0].completion_ids)
    assert {k: v for k, v in got[1].items() if not k.startswith("time/")} == {
        k: v for k, v in want[1].items() if not k.startswith("time/")}


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
