import torch

from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train.logprobs import PAD_COST, build_micro_batch, completion_logprobs, plan_micro_batches


def _setup():
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, max_positions=64, seed=0)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "34+56=", "7="]]
    comps = torch.tensor([[5, 6, 1, 0, 0], [7, 8, 9, 10, 1], [4, 1, 0, 0, 0]])
    mask = (torch.arange(5)[None] < torch.tensor([3, 5, 2])[:, None]).long()
    return model, tok, build_micro_batch([0, 1, 2], prompts, comps, mask, tok.pad_token_id)


def test_chunked_logprobs_equal_full_logits_reference():
    model, tok, mb = _setup()
    full_ids, att = mb.input_ids, mb.attention_mask
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=full_ids, attention_mask=att, position_ids=pos).logits / 0.9
    P, L = mb.prompt_len, mb.targets.shape[1]
    ref = torch.log_softmax(logits[:, P - 1:P - 1 + L], -1).gather(-1, mb.targets[..., None]).squeeze(-1) * mb.mask
    for chunk, budget in [(1024, 256 << 20), (2, 256 << 20), (2, 0)]:       # one shot, chunks, checkpointed chunks
        lp, ent = completion_logprobs(model, mb, temperature=0.9, chunk_tokens=chunk, logits_budget_bytes=budget,
                                      want_entropy=True)
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
        assert (ent >= 0).all()


def test_checkpointed_chunks_give_the_same_gradient():
    model, tok, mb = _setup()
    grads = []
    for budget in (256 << 20, 0):
        model.zero_grad()
        lp, _ = completion_logprobs(model, mb, chunk_tokens=3, logits_budget_bytes=budget)
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])


def test_plan_groups_similar_lengths():
    plan = plan_micro_batches([5, 50, 6, 49, 7, 51], 2)
    assert plan == [[0, 2], [4, 3], [1, 5]]


def test_plan_keeps_a_prompts_rows_together_when_that_feeds_fewer_tokens():
    # two prompts of 10 tokens, 4 rows each, completions of 2-5 tokens: sorting by length mixes the
    # prompts in every micro-batch (each runs twice); keeping them together runs each once
    prompts = [[1] * 10] * 4 + [[2] * 10] * 4
    comp = [2, 5, 3, 4, 5, 2, 4, 3]
    plan = plan_micro_batches([10 + c for c in comp], 4, prompts)
    assert sorted(map(sorted, plan)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _fed(mb, prompts, comp):
    """What a micro-batch feeds the lean forward's matmuls, counted independently of the planner:
    each distinct prompt once, each completion but its last token, a padded position at PAD_COST."""
    fed = [c - 1 for c in (comp[i] for i in mb)]
    return sum(len(p) for p in {tuple(prompts[i]) for i in mb}) + sum(fed) + PAD_COST * sum(max(fed) - f for f in fed)


def test_plan_keeps_full_length_groups_as_they_are():
    prompts = [[7] * 12] * 4 + [[8] * 9] * 4 + [[9] * 12] * 4
    plan = plan_micro_batches([len(p) + 16 for p in prompts], 4, prompts)
    assert sorted(map(sorted, plan)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_plan_packs_short_completions_into_fewer_larger_micro_batches():
    # five prompts x 4 rows; in each group one completion runs to 30 tokens, the others end at 2-4
    g = torch.Generator().manual_seed(0)
    prompts = [[k] * 8 for k in range(5) for _ in range(4)]
    comp = [30 if i % 4 == 0 else int(torch.randint(2, 5, (1,), generator=g)) for i in range(20)]
    plan = plan_micro_batches([len(p) + c for p, c in zip(prompts, comp)], 4, prompts)
    assert sorted(i for mb in plan for i in mb) == list(range(20))           # every row once
    budget = 8 + 4 * 29                                                       # 4 full rows under the prompt
    assert all(_fed(mb, prompts, comp) <= budget for mb in plan)
    assert len(plan) < 5 and max(map(len, plan)) > 4                        # fewer, larger than 4 rows
    # one-token prompts and very ragged completions: each micro-batch within the budget too
    prompts = [[1]] * 4 + [[2]] * 4
    comp = [1, 60, 2, 61, 59, 1, 62, 2]
    plan = plan_micro_batches([1 + c for c in comp], 4, prompts)
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    assert all(_fed(mb, prompts, comp) <= 1 + 4 * 61 for mb in plan)


def test_plan_merges_groups_whose_longest_completions_differ():
    """With EOS, each group's rows end at their own lengths and each group has its own longest: putting
    two groups in one micro-batch pads the shorter group's rows in attention. That padding costs far
    less than one more micro-batch (each pays its weight-gradient accumulation and runs smaller
    GEMMs), so the plan takes several groups per micro-batch, within the budget, not one each."""
    g = torch.Generator().manual_seed(1)
    prompts = [[k + 1] * 50 for k in range(8) for _ in range(8)]
    comp = []
    for k in range(8):                              # group k: its longest row 10 + 7k tokens, the rest 4-12
        comp += [10 + 7 * k] + [int(torch.randint(4, 13, (1,), generator=g)) for _ in range(7)]
    plan = plan_micro_batches([len(p) + c for p, c in zip(prompts, comp)], 8, prompts)
    assert sorted(i for mb in plan for i in mb) == list(range(64))            # every row once
    budget = 50 + 8 * (max(comp) - 1)
    assert all(_fed(mb, prompts, comp) <= budget for mb in plan)
    assert len(plan) <= 4                                                     # 8 groups, at most 4 micro-batches
    assert all(len({tuple(prompts[i]) for i in mb}) == len({i // 8 for i in mb}) for mb in plan)
    for mb in plan:                                 # a group's rows stay together (its prompt runs once)
        assert all(set(range(8 * (i // 8), 8 * (i // 8) + 8)) <= set(mb) for i in mb)
