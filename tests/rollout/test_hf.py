import math

import torch

from grpokit.rollout.base import SamplingParams, sample_next
from grpokit.rollout.hf import HFEngine
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train.logprobs import build_micro_batch, completion_logprobs


def _model(seed=0):
    tok = build_char_tokenizer("0123456789+= ")
    return build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, max_positions=64, seed=seed), tok


def test_greedy_matches_transformers_generate():
    model, tok = _model()
    model.eval()
    prompts = ["12+3=", "7+80=", "1="]                     # different lengths -> left padding
    eng = HFEngine(model, tok)
    batch = eng.generate([tok(p)["input_ids"] for p in prompts], SamplingParams(n=2, max_new_tokens=6, temperature=0))
    for i, p in enumerate(prompts):
        ids = torch.tensor([tok(p)["input_ids"]])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
        ref = ref.tolist()
        if tok.eos_token_id in ref:
            ref = ref[:ref.index(tok.eos_token_id) + 1]
        for g in range(2):
            row = 2 * i + g
            got = batch.completion_ids[row, :int(batch.completion_mask[row].sum())].tolist()
            assert got == ref


def test_sampler_logprobs_equal_recomputed_logprobs_and_groups_share_the_prompt():
    model, tok = _model(1)
    eng = HFEngine(model, tok)
    prompts = [tok(p)["input_ids"] for p in ["12+3=", "99+99="]]
    gen = torch.Generator().manual_seed(0)
    batch = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=0.7), gen)
    assert len(batch) == 8 and batch.prompt_ids[0] == batch.prompt_ids[3] == prompts[0]
    assert set(batch.finish_reason) <= {"eos", "length"}
    for i, fr in enumerate(batch.finish_reason):
        n = int(batch.completion_mask[i].sum())
        ends_eos = batch.completion_ids[i, n - 1].item() == tok.eos_token_id
        assert ends_eos == (fr == "eos")
        if fr == "length":
            assert n == 8
    mb = build_micro_batch(list(range(8)), batch.prompt_ids, batch.completion_ids, batch.completion_mask, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, mb, temperature=0.7)
    torch.testing.assert_close(lp * mb.mask, batch.sampler_logprobs * batch.completion_mask, atol=2e-5, rtol=1e-4)


def test_over_confidence_resampling_never_emits_the_confident_token():
    torch.manual_seed(0)
    logits = torch.randn(500, 12) * 4
    logits[:, 3] += 6                                       # token 3 usually dominates
    params = SamplingParams(temperature=1.0, resample_threshold=0.7)
    gen = torch.Generator().manual_seed(1)
    tok, lp, res = sample_next(logits, params, gen)
    probs = torch.softmax(logits, -1)
    top_p, top_i = probs.max(-1)
    fired = top_p > 0.7
    assert fired.sum() > 100 and torch.equal(res, fired)
    assert not (tok[fired] == top_i[fired]).any()
    # recorded log-prob = log of the renormalised distribution without the top token
    q = probs.clone()
    q[fired, top_i[fired]] = 0
    q = q / q.sum(-1, keepdim=True)
    torch.testing.assert_close(lp, q.gather(-1, tok[:, None]).squeeze(-1).log(), atol=1e-5, rtol=1e-5)


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    tok, lp, _ = sample_next(logits, SamplingParams(temperature=1.0, top_k=2), gen)
    assert set(tok.tolist()) == {0, 1}
    p = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    assert math.isclose(float(lp[tok == 0][0]), float(p[0].log()), rel_tol=1e-5)
    tok, _, _ = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.5), gen)
    assert set(tok.tolist()) == {0}                          # p(0) = 0.64 >= 0.5 alone
