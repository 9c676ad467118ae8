import torch

from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train.logprobs import build_micro_batch, completion_logprobs, plan_micro_batches


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


def test_shared_prompts_give_the_same_logprobs_and_gradient(monkeypatch):
    # rows 0, 2, 3 share a prompt, rows 1 and 4 another (of a different length): each distinct prompt
    # runs once and its completions attend to its cache; the result must equal the plain forward
    import grpokit.train.logprobs as lp_mod

    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, seed=1)
    a, b = tok("12+34=")["input_ids"], tok("5=")["input_ids"]
    prompts = [a, b, a, a, b]
    comps = torch.tensor([[5, 6, 1, 0], [7, 8, 9, 1], [4, 1, 0, 0], [9, 9, 9, 9], [3, 0, 0, 0]])
    mask = (torch.arange(4)[None] < torch.tensor([3, 4, 2, 4, 1])[:, None]).long()
    mb = build_micro_batch([0, 1, 2, 3, 4], prompts, comps, mask, tok.pad_token_id)
    out = []
    for share in (True, False):
        monkeypatch.setattr(lp_mod, "shares_prompts", lambda m, s=share: s)
        model.zero_grad()
        lp, _ = completion_logprobs(model, mb, temperature=0.7)
        lp.sum().backward()
        out.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=1e-4)
