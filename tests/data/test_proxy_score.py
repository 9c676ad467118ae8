"""The combined proxy score of Dr. GRPO as practised: proxies summed with weights and a threshold,
with the "uninformative" term (a rewarded completion that is degenerate) the single proxies lack."""

import copy

import pytest

from grpokit.config import load_config
from grpokit.data.filters import DEFAULT_WEIGHTS, ProxyScore, degeneracy, format_only, proxy_scores, repetition, work_words
from grpokit.errors import ConfigError
from grpokit.train import build_trainer
from grpokit.train.transforms import StepContext, build_transforms
from tests.fixtures import arithmetic_files, small_overrides, tiny_model_dir


def test_degeneracy_measures():
    assert repetition("46 46 46 46 46") == pytest.approx(1 - 1 / 5)          # one distinct word of five
    assert repetition("26 + 20 = 46") == 0.0
    loop = "The answer is 46. " * 4                                           # 16 words: trigrams, 4 distinct of 14
    assert repetition(loop) == pytest.approx(1 - 4 / 14)
    assert repetition("1 2 1") == 0.0                                         # too short to judge
    assert format_only("<think></think><answer>5</answer>") and not format_only("<think>2+3=5</think><answer>5</answer>")
    assert not format_only("<answer>46</answer>")             # a tagged answer alone: an answer without work
    assert repetition("<think>20+26</think><answer>46</answer>") == 0.0   # tag names are not words
    assert not format_only("\\boxed{5}")                                     # a bare box is an answer without work
    assert work_words("\\boxed{5}") == 0 and work_words("First 2*3=6, so \\boxed{7}") == 5
    assert work_words("The answer is 46") == 3                                # the last number is the answer
    assert degeneracy("\\boxed{5}") == 0.0 and degeneracy("\\boxed{5}", min_work_words=3) == 1.0
    assert degeneracy("<think> </think><answer>5</answer>") == 1.0 and degeneracy("<answer>5</answer>") == 0.0


def test_the_score_is_the_weighted_sum_and_only_rewarded_samples_are_uninformative():
    # one group of four (mean reward 0.5) and one of two (mean 0.5), limit 10 tokens
    completions = ["46 46 46 46 46", "26 + 20 = 46", "46 46 46 46 46", "x", "a long answer", "a long answer"]
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    out = proxy_scores(ProxyScore(), completions=completions, lengths=[5, 5, 5, 1, 8, 10],
                       finish_reason=["eos", "eos", "eos", "eos", "eos", "length"], rewards=rewards,
                       group_ids=[0, 0, 0, 0, 1, 1], max_new_tokens=10)
    w = DEFAULT_WEIGHTS
    assert out[0]["uninformative"] == pytest.approx(0.8) and out[0]["score"] == pytest.approx(w["uninformative"] * 0.8)
    assert out[1]["score"] == 0.0                               # rewarded and informative
    assert out[2]["uninformative"] == 0.0                        # degenerate but below the mean: kept, it teaches
    assert out[2]["duplicate"] == 1.0 and out[2]["score"] == pytest.approx(w["duplicate"])
    assert out[4]["length"] == pytest.approx(2 * 8 / 10 - 1)    # 0 at half the limit, 1 at it
    assert out[5]["length"] == 0.0                               # truncated: its length is the cut, counted once
    assert out[5]["score"] == pytest.approx(w["truncated"] + w["duplicate"])
    dropped = [i for i, p in enumerate(out) if p["score"] >= 1.0]
    assert dropped == [0]                                        # one strong sign; weak ones alone do not
    # truncated and a failed format check: two weak signs drop it
    out = proxy_scores(ProxyScore(format_reward="fmt"), completions=["a", "b"], lengths=[4, 4],
                       finish_reason=["length", "length"], rewards=[0.0, 0.0], group_ids=[0, 0], max_new_tokens=4,
                       per_fn={"fmt": [1.0, 0.0]})
    assert [p["score"] >= 1.0 for p in out] == [False, True]
    # a format reward: failing it is one weak sign
    out = proxy_scores(ProxyScore(format_reward="fmt", weights={"format": 1.0}), completions=["a", "b"],
                       lengths=[1, 1], finish_reason=["eos", "eos"], rewards=[1.0, 0.0], group_ids=[0, 0],
                       max_new_tokens=4, per_fn={"fmt": [1.0, 0.0]})
    assert [p["score"] for p in out] == [0.0, 1.0]


def test_weights_are_checked():
    with pytest.raises((ConfigError, ValueError), match="unknown proxy 'uninformativ'.*uninformative"):
        load_config(None, ["algorithm.sample_filter.weights={uninformativ: 1.0}"])
    with pytest.raises((ConfigError, ValueError), match="score_threshold"):
        load_config(None, ["algorithm.sample_filter.score_threshold=0"])


def test_the_trainer_drops_rewarded_repeats(tmp_path):
    """On a collected batch whose reward paid for repeats, the rewarded repeated completions are
    exactly the ones the run's filter drops (recomputed here), and they leave the loss and the
    group statistics; a repeat that was not rewarded stays."""
    model_dir, train = tiny_model_dir(tmp_path / "model"), arithmetic_files(tmp_path / "data")[0]
    cfg = load_config(None, small_overrides(model_dir, train, tmp_path / "run", **{
        "rollout.max_new_tokens": 5, "algorithm.sample_filter.score_threshold": 1.0}))
    tr = build_trainer(cfg, health=False)
    batch, _ = tr.step_fn.collector.collect(0)
    G = cfg.rollout.group_size
    for g in range(len(batch) // G):       # in every group: one rewarded repeat, one unrewarded, the rest honest
        for k in range(G):
            i = g * G + k
            batch.completions[i] = ["7 7 7 7 7", "7 7 7 7 7 7", "3", "12 + 4 = 16"][k % 4]
            batch.rewards[i] = [1.0, 0.0, 0.0, 1.0][k % 4]
            batch.finish_reason[i] = "eos"
            batch.lengths[i] = 1
    (filt,) = [t for t in tr.step_fn.transforms if t.name == "proxy_filter"]
    untouched = copy.deepcopy(batch)
    ctx = StepContext(step=0)
    out = filt(batch, ctx)
    dropped = [i for i in range(len(batch)) if not out.loss_mask[i].any()]
    assert dropped == [i for i in range(len(batch)) if i % G % 4 == 0]
    assert all(out.rewards[i] != out.rewards[i] for i in dropped)           # NaN: out of the group statistics
    assert ctx.metrics["filter/dropped_score"] == len(dropped) == ctx.metrics["filter/uninformative"]
    # the same batch without the score: nothing dropped (no single proxy fires)
    off = load_config(None, small_overrides(model_dir, train, tmp_path / "run2"))
    (plain,) = [t for t in build_transforms(off, tokenizer=tr.tokenizer, curriculum=None) if t.name == "proxy_filter"]
    ctx = StepContext(step=0)
    kept = plain(untouched, ctx)
    assert ctx.metrics["filter/dropped"] == 0 and bool(kept.loss_mask.any(dim=1).all())
