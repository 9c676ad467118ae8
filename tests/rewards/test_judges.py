"""Model judges (grpokit.rewards.judges), on tiny models built here: `reward_model` scores as its
classifier does one text at a time (batching and padding change nothing), squashed or normalised
per group as asked; `llm_judge`, taught in a few hundred supervised steps to say 10 for a computed
answer and 0 for the question copied back, judges unseen ones, answers repeats from its cache, and serves as a run's
independent held-out checker."""

import json
import logging
import random
import statistics

import pytest
import torch

from grpokit.config import load_config
from grpokit.rewards import RewardSet
from grpokit.rewards import judges
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained

CHARS = "0123456789+=? "


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = build_char_tokenizer(CHARS)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, num_labels=1,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return save_pretrained(Qwen2ForSequenceClassification(cfg), tok, tmp_path_factory.mktemp("rm") / "rm")


def _alone(path, texts):
    """Each text's score through the classifier alone: no batch, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    m = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(m(**tok(t, return_tensors="pt")).logits[0, -1]) for t in texts]


def test_a_reward_model_scores_each_text_as_its_classifier_does_alone(classifier):
    prompts = ["12+3=", "7+7=", "40+2=", "1+1="] * 2
    completions = ["15", "14", "9999", "2", "1", "", "42", "22"]
    rs = RewardSet.from_specs([{"name": "reward_model", "args": {"model": str(classifier), "batch_size": 3}}])
    got = rs.score(prompts, completions, {}).per_fn["reward_model"]
    want = _alone(classifier, [p + c for p, c in zip(prompts, completions)])
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 6) for v in got)) > 3                       # a real, varied score
    sig = RewardSet.from_specs([{"name": "reward_model", "args": {"model": str(classifier), "squash": "sigmoid"}}])
    assert sig.score(prompts, completions, {}).per_fn["reward_model"] == pytest.approx(
        [1 / (1 + torch.exp(torch.tensor(-v)).item()) for v in want], abs=1e-5)


def test_a_judges_settings_never_come_from_a_column(classifier):
    """The trainer passes a `max_new_tokens` column to every reward, and a dataset may hold a column
    named like a judge's setting (`model`, `device`): the judge reads its settings from its args."""
    rs = RewardSet.from_specs([{"name": "reward_model", "args": {"model": str(classifier)}}])
    cols = {"model": ["/elsewhere", "/elsewhere"], "device": ["meta", "meta"], "max_new_tokens": [8, 8]}
    got = rs.score(["1+1=", "2+2="], ["2", "4"], cols).per_fn["reward_model"]
    assert got == pytest.approx(_alone(classifier, ["1+1=2", "2+2=4"]), abs=1e-5)


def test_a_reward_model_normalised_per_group(classifier):
    prompts, completions = ["3+4="] * 6, ["7", "6", "77", "1", "7", "70"]
    groups = [0, 0, 0, 1, 1, 1]
    rs = RewardSet.from_specs([{"name": "reward_model", "args": {"model": str(classifier), "normalize": "group"}}])
    got = rs.score(prompts, completions, {"group_id": groups}).per_fn["reward_model"]
    raw = _alone(classifier, [p + c for p, c in zip(prompts, completions)])
    for g in (0, 1):
        vals = [raw[i] for i in range(6) if groups[i] == g]
        m, s = statistics.mean(vals), statistics.stdev(vals)
        assert [got[i] for i in range(6) if groups[i] == g] == pytest.approx([(v - m) / s for v in vals], abs=1e-4)


@pytest.mark.parametrize("args, match", [
    ({}, "needs args.model"),
    ({"model": "/nonexistent/judge"}, "not a local model directory"),
    ({"model": "{rm}", "dtype": "float64"}, "dtype must be one of"),
])
def test_a_judge_without_a_usable_model_is_a_config_error(classifier, args, match):
    args = {k: v.format(rm=classifier) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        load_config(None, [f"rewards=[{{name: llm_judge, args: {json.dumps(args)}}}]"])


def test_parse_score():
    assert judges.parse_score(" 7 because", 10) == 0.7
    assert judges.parse_score("score: 12", 10) == 1.0 and judges.parse_score("-3", 10) == 0.0
    assert judges.parse_score("no idea", 10) is None and judges.parse_score("4.5/5", 5) == 0.9


# ----------------------------------------------------------------------- a judge that learned
def _sums(n, rng):
    """(prompt, completion, honest): the sum computed, or the question's expression copied back."""
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        honest = rng.random() < 0.5
        out.append((f"{a}+{b}=", str(a + b) if honest else f"{a}+{b}", honest))
    return out


@pytest.fixture(scope="module")
def judge(tmp_path_factory):  # about 10 s of supervised steps on 2 cores
    """A tiny LM taught to answer "10" after a computed answer and "0" after the question copied
    back (the expression-in-the-box hack; rubric "{prompt}{completion}?")."""
    from grpokit.train.sft import sft

    tok = build_char_tokenizer(CHARS)
    torch.manual_seed(0)
    model = build_tiny_model(tok, hidden=64, layers=2, heads=4, intermediate=192, max_positions=48, seed=0)
    sft(model, tok, lambda n, rng: [(f"{p}{c}?", "10" if ok else "0") for p, c, ok in _sums(n, rng)],
        steps=300, lr=2e-3, seed=0)
    return save_pretrained(model, tok, tmp_path_factory.mktemp("judge") / "judge")


ARGS = {"rubric": "{prompt}{completion}?", "chat": False, "scale": 10, "answer_tokens": 3}


@pytest.mark.slow
def test_a_taught_llm_judge_tells_answers_from_copies_and_caches(judge):
    cases = _sums(64, random.Random(123))
    prompts, completions = [p for p, _, _ in cases], [c for _, c, _ in cases]
    rs = RewardSet.from_specs([{"name": "llm_judge", "args": {"model": str(judge), **ARGS}}])
    before = dict(judges.STATS)
    first = rs.score(prompts, completions, {}).per_fn["llm_judge"]
    agree = sum((v == 1.0) == ok for v, (_, _, ok) in zip(first, cases)) / len(cases)
    print(f"\nllm_judge agrees with the truth on {agree:.0%} of 64 unseen cases")
    assert agree >= 0.9 and None not in first
    assert judges.STATS["cache_hits"] - before["cache_hits"] == 0
    again = rs.score(prompts, completions, {}).per_fn["llm_judge"]
    assert again == first                                             # greedy, and from the cache
    assert judges.STATS["cache_hits"] - before["cache_hits"] == 64


@pytest.mark.slow
def test_an_llm_judge_as_the_independent_held_out_checker(judge, tmp_path, caplog):
    """eval.checker names the judge: a run with a rule-based training reward is scored on held-out
    prompts by the judge, and says the checker is independent."""
    from grpokit.train import build_trainer
    from tests.fixtures import small_overrides, tiny_model_dir

    rows = [{"prompt": p, "answer": str(eval(p[:-1]))} for p, _, _ in _sums(40, random.Random(5))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    caplog.set_level(logging.INFO, logger="grpokit.train")
    cfg = load_config(None, small_overrides(tiny_model_dir(tmp_path / "policy"), tmp_path / "train.jsonl",
                                            tmp_path / "run", **{
        "data.eval_path": tmp_path / "held.jsonl", "train.steps": 1, "eval.checker": "llm_judge",
        "eval.checker_args": json.dumps({"model": str(judge), **ARGS})}))
    tr = build_trainer(cfg, health=False)
    assert tr.checker.names == ["llm_judge"]
    assert "held-out pass@1 is scored by llm_judge (eval.checker)" in caplog.text
    out = tr.run_eval()
    assert 0.0 <= out["eval/pass@1"] <= 1.0


def test_the_memory_planner_counts_a_judge_on_the_policys_device(classifier, tmp_path):
    """A judge's weights stay resident through every phase: the estimate grows by exactly its
    parameters x 4 bytes (float32), once however often the run uses it, and not at all for a
    judge placed on another device."""
    from grpokit.train.memory import estimate_config
    from tests.fixtures import tiny_model_dir

    from transformers import AutoModelForSequenceClassification

    n = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(classifier).parameters())
    policy = tiny_model_dir(tmp_path / "policy")
    base = ["model.path=" + str(policy), "model.device=cpu"]
    judge = json.dumps({"model": str(classifier)})
    plain = estimate_config(load_config(None, base), device="cpu", prompt_tokens=16)
    with_judge = estimate_config(load_config(None, base + [
        f"rewards=[{{name: math_accuracy}}, {{name: reward_model, weight: 0.1, args: {judge}}}]",
        "eval.checker=reward_model", f"eval.checker_args={judge}"]), device="cpu", prompt_tokens=16)
    assert with_judge.parts["judges"] == 4 * n
    assert with_judge.peak - plain.peak == pytest.approx(4 * n)
    elsewhere = json.dumps({"model": str(classifier), "device": "cuda"})
    away = estimate_config(load_config(None, base + [
        f"rewards=[{{name: math_accuracy}}, {{name: reward_model, weight: 0.1, args: {elsewhere}}}]"]),
        device="cpu", prompt_tokens=16)
    assert "judges" not in away.parts and away.peak == plain.peak
