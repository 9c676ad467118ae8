"""Trainer invariants on a tiny saved Qwen2 model: micro-batching, resume, loading from disk."""

import json

import pytest
import torch

from grpokit.config import load_config
from grpokit.train import build_trainer
from grpokit.models.hf import check_round_trip, load_model, load_tokenizer
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    model_dir = tiny_model_dir(root / "model")
    train, held = arithmetic_files(root / "data")
    return root, model_dir, train, held


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_saved_qwen2_directory_loads_and_tokenizer_round_trips(setup):
    _, model_dir, _, _ = setup
    tok = load_tokenizer(model_dir)
    text = "12 + 35 = 47"
    assert tok.decode(tok(text)["input_ids"]) == text                # spaces survive a save/load
    check_round_trip(tok, [text])
    model = load_model(model_dir, dtype="float32", device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    out = model(torch.tensor([tok("1+1=")["input_ids"]]))
    assert out.logits.shape[-1] == len(tok)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_give_the_whole_batch_gradient(setup, agg):
    root, model_dir, train, _ = setup
    weights = []
    for mbs in (16, 3):
        cfg = load_config(None, small_overrides(model_dir, train, root / f"mb{mbs}{agg}", **{
            "optim.micro_batch_size": mbs, "algorithm.loss_agg": agg, "train.steps": 1,
            "algorithm.kl.beta": 0.05, "algorithm.kl.controller": "fixed", "rewards": "[{name: test_varied}]",
            "optim.max_grad_norm": 1e9}))
        torch.manual_seed(0)
        tr = build_trainer(cfg, health=False)
        tr.model.double()
        if tr.reference is not None:
            tr.reference.module.double()
        m = tr.step()
        assert m["optim/grad_norm"] > 0
        weights.append(_weights(tr.model))
    torch.testing.assert_close(weights[0], weights[1], atol=1e-10, rtol=1e-8)


def test_resume_continues_exactly(setup):
    root, model_dir, train, _ = setup
    common = {"algorithm.kl.beta": 0.05, "rewards": "[{name: test_varied}]", "train.save_every": 3,
              "algorithm.mu": 2, "algorithm.mini_batches": 2}
    straight = build_trainer(load_config(None, small_overrides(model_dir, train, root / "straight", **common,
                                                               **{"train.steps": 6})), health=False)
    straight.train()
    half = build_trainer(load_config(None, small_overrides(model_dir, train, root / "resumed", **common,
                                                           **{"train.steps": 3})), health=False)
    half.train()
    resumed = build_trainer(load_config(None, small_overrides(model_dir, train, root / "resumed", **common,
                                                              **{"train.steps": 6})), health=False)
    resumed.train(resume=True)
    assert resumed.step_idx == 6
    torch.testing.assert_close(_weights(straight.model), _weights(resumed.model), atol=1e-6, rtol=1e-5)
    rows_a = [json.loads(x) for x in (root / "straight" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (root / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(rows_a, rows_b):
        for k in ("reward/mean", "loss/policy", "completion/length_mean", "kl/beta"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def test_a_throwing_reward_does_not_stop_training(setup):
    root, model_dir, train, _ = setup
    from grpokit import rewards

    @rewards.register("test_always_raises")
    def _boom(prompts, completions, **columns):
        raise RuntimeError("boom")

    cfg = load_config(None, small_overrides(model_dir, train, root / "boom", **{
        "rewards": "[{name: exact_match}, {name: test_always_raises, weight: 0.5}]"}))
    tr = build_trainer(cfg, health=False)
    m = tr.train()
    assert tr.step_idx == 2
    assert m["reward/test_always_raises/errors"] >= 1
    assert m["group/frac_zero_std"] == 1.0                 # every sample excluded -> advantage 0


def test_rewards_and_crosscheck_plug_in_from_yaml(setup, tmp_path):
    root, model_dir, train, _ = setup
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        "rewards:\n"
        "  - {name: math_accuracy, weight: 1.0}\n"
        "  - {name: soft_overlong, weight: 0.5, args: {max_len: 4, cache: 2}}\n"
        "crosscheck: {primary: math_accuracy, checker: math_accuracy_alt, fraction: 1.0}\n")
    over = [o for o in small_overrides(model_dir, train, root / "xcheck") if not o.startswith("rewards=")]
    tr = build_trainer(load_config(str(cfg_file), over), health=False)
    m = tr.step()
    assert "reward/math_accuracy/mean" in m and "reward/soft_overlong/mean" in m
    assert m["reward/soft_overlong/mean"] <= 0
    assert 0.0 <= m["reward/checker_disagreement"] <= 1.0
    assert m["reward/checker_checked"] == 16


def test_mask_truncated_takes_truncated_rows_out_of_the_loss(setup):
    """Overlong filtering (`algorithm.mask_truncated`, presets/dapo.yaml): a completion that
    finished by length gets no loss. The batch is arranged so that only truncated rows carry a
    learning signal: the first two groups are marked truncated and get varied rewards, the last
    two finish by EOS with equal rewards (advantage 0). With the flag their loss mask is zero and
    no gradient is left; without it the same batch trains."""
    root, model_dir, train, _ = setup
    from grpokit import rewards

    if "test_varied_if_truncated" not in rewards.REGISTRY:
        @rewards.register("test_varied_if_truncated")
        def _varied_if_truncated(prompts, completions, finish_reason, **columns):
            return [float(i % 2) if f == "length" else 1.0 for i, f in enumerate(finish_reason)]

    for flag in (True, False):
        cfg = load_config(None, small_overrides(model_dir, train, root / f"mask_truncated_{flag}", **{
            "algorithm.mask_truncated": flag, "algorithm.kl.beta": 0.0, "train.steps": 1,
            "rewards": "[{name: test_varied_if_truncated}]"}))
        torch.manual_seed(0)
        tr = build_trainer(cfg, health=False)
        G = cfg.rollout.group_size
        sample, update, seen = tr.collector.sample, tr.worker.train_step, []

        def sample_two_groups_truncated(rows, *streams):
            batch = sample(rows, *streams)
            batch.finish_reason = ["length" if i < 2 * G else "eos" for i in range(len(batch))]
            return batch

        def spy_update(data, beta, **kw):
            seen.append(data)
            return update(data, beta, **kw)

        tr.collector.sample, tr.worker.train_step = sample_two_groups_truncated, spy_update
        before = _weights(tr.model).clone()
        m = tr.step()
        data = seen[0]
        full = data.mask
        assert full[: 2 * G].sum() > 0                                  # the truncated rows have tokens
        assert data.advantages[: 2 * G].abs().sum() > 0 and data.advantages[2 * G:].abs().sum() == 0
        if flag:
            assert data.loss_mask[: 2 * G].sum() == 0                   # truncated rows: no loss ...
            assert torch.equal(data.loss_mask[2 * G:], full[2 * G:])    # ... the others untouched
            assert m["optim/grad_norm"] == 0.0
            torch.testing.assert_close(_weights(tr.model), before, atol=0, rtol=0)
        else:
            assert torch.equal(data.loss_mask, full)
            assert m["optim/grad_norm"] > 0
            assert not torch.equal(_weights(tr.model), before)


def test_logprob_min_is_logged_every_step(setup):
    """`policy/logprob_min`: the smallest log-prob of the step's trained tokens under the policy
    before its update, recomputed independently here."""
    root, model_dir, train, _ = setup
    cfg = load_config(None, small_overrides(model_dir, train, root / "lpmin", **{
        "train.steps": 1, "algorithm.kl.beta": 0.05, "rewards": "[{name: test_varied}]"}))
    tr = build_trainer(cfg, health=False)
    seen = []
    real = tr.worker.train_step

    def spy(batch, beta, **kw):
        lp = tr.worker.logprobs(batch, "policy")
        seen.append(float(lp[batch.loss_mask.bool()].min()))
        return real(batch, beta, **kw)

    tr.worker.train_step = spy
    m = tr.step()
    assert m["policy/logprob_min"] < 0
    assert m["policy/logprob_min"] == pytest.approx(seen[0], abs=1e-5)
