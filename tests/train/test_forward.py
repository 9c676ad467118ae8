"""grpokit's own training forward (grpokit.train.forward) against the model's forward: log-probs and
gradients, with repeated prompts of different lengths, ragged completions, grouped KV heads; and the
cases where it must step aside."""

import pytest
import torch
import torch.nn.functional as F

from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train import forward as lean
from grpokit.train.dropout import hidden_dropout
from grpokit.train.logprobs import build_micro_batch, completion_logprobs, uses_lean_forward


def _model(arch, seed=1, dtype=torch.float64):
    """A tiny model; in float64 its RMSNorms normalise in float64 too (transformers' own normalise
    in float32 whatever the dtype), so both paths compute the same function to float64 rounding."""
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, arch=arch, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                             max_positions=64, seed=seed).to(dtype)
    if dtype == torch.float64:
        for mod in model.modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.forward = lambda x, mod=mod: F.rms_norm(x, (x.shape[-1],), mod.weight, mod.variance_epsilon)
    return tok, model


def _batch(tok, L=5):
    # prompts a (x3), b (x2), c (x1) of lengths 6, 2, 4: left padding differs per prompt; the
    # completions end at different places (one of length 1)
    a, b, c = (tok(p)["input_ids"] for p in ("12+34=", "5=", "9+9="))
    prompts = [a, b, a, c, a, b]
    g = torch.Generator().manual_seed(0)
    comps = torch.randint(3, 12, (len(prompts), L), generator=g)
    lens = torch.tensor([3, L, 1, L, 2, 4]).clamp(max=L)
    mask = (torch.arange(L)[None] < lens[:, None]).long()
    return build_micro_batch(list(range(len(prompts))), prompts, comps, mask, tok.pad_token_id)


def _reference(model, mb, temperature):
    """Log-probs from the model's own full forward and full-vocabulary logits."""
    att = mb.attention_mask
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=mb.input_ids, attention_mask=att, position_ids=pos).logits / temperature
    P, L = mb.prompt_len, mb.targets.shape[1]
    return torch.log_softmax(logits[:, P - 1:P - 1 + L], -1).gather(-1, mb.targets[..., None]).squeeze(-1) * mb.mask


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _both_paths(model, mb, temperature, before_lean=None):
    """(lean log-probs, the model's own, the model's own gradients) of a random weighting of the
    log-probs; the lean path's gradients are left in `.grad`."""
    w = torch.randn(mb.targets.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    model.zero_grad()
    want = _reference(model, mb, temperature)
    (want * w).sum().backward()
    g_want = _grads(model).clone()
    model.zero_grad()
    if before_lean is not None:
        before_lean()
    got, _ = completion_logprobs(model, mb, temperature=temperature)
    (got * w).sum().backward()
    return got, want, g_want


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("L", [5, 1])
def test_lean_forward_equals_the_models_forward(arch, L):
    tok, model = _model(arch)
    mb = _batch(tok, L)
    assert uses_lean_forward(model, mb.attention_mask, mb.prompt_len)
    got, want, g_want = _both_paths(model, mb, 0.7)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(_grads(model), g_want, atol=1e-10, rtol=1e-8)
    assert _grads(model).abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lean_forward_matches_in_float32(arch):
    tok, model = _model(arch, dtype=torch.float32)
    mb = _batch(tok)
    model.zero_grad()
    want = _reference(model, mb, 1.0)
    want.sum().backward()
    g_want = _grads(model).clone()
    model.zero_grad()
    got, _ = completion_logprobs(model, mb)
    got.sum().backward()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(_grads(model), g_want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_pad_id_as_a_real_token_gets_one_gradient_on_both_paths(arch):
    """A pad id that is a real token (a chat separator that is also the pad token, or one sampled
    mid-completion): `nn.Embedding(padding_idx=...)` would zero its lookups' gradient on the model's
    forward while grpokit's own forward keeps it. The worker makes both take the true gradient."""
    from grpokit.config import load_config
    from grpokit.train.worker import LocalWorker

    tok, model = _model(arch)
    pad = tok.pad_token_id
    assert model.get_input_embeddings().padding_idx == pad
    mb = _batch(tok)
    mb.input_ids[0, mb.prompt_len + 1] = mb.targets[0, 1] = pad      # a real, unmasked completion token
    mb.input_ids[2, mb.prompt_len] = mb.targets[2, 0] = pad
    LocalWorker(load_config(None, []), model, tok, None)               # prepares the policy
    emb = model.get_input_embeddings().weight
    rows = []
    for lean_on in (True, False):
        model.zero_grad()
        lean._enabled = lean_on
        try:
            assert uses_lean_forward(model, mb.attention_mask, mb.prompt_len) == lean_on
            completion_logprobs(model, mb)[0].sum().backward()
        finally:
            lean._enabled = True
        rows.append(emb.grad[pad].clone())
    # the true derivative along a direction, by central differences on the model's own forward
    v = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(3), dtype=emb.dtype)
    eps = 1e-6
    with torch.no_grad():
        emb[pad] += eps * v
        up = _reference(model, mb, 1.0).sum()
        emb[pad] -= 2 * eps * v
        down = _reference(model, mb, 1.0).sum()
        emb[pad] += eps * v
    fd = float((up - down) / (2 * eps))
    for g in rows:
        assert float(g @ v) == pytest.approx(fd, rel=1e-5, abs=1e-8)
    torch.testing.assert_close(rows[0], rows[1], atol=1e-10, rtol=1e-8)


def test_shared_prompts_get_the_sum_of_their_completions_gradients():
    # a prompt's embedding gradient must be the same whether its completions come in one
    # micro-batch (prompt run once, gathered) or one row at a time (prompt run per row)
    tok, model = _model("qwen2")
    mb = _batch(tok)
    emb = model.get_input_embeddings().weight
    model.zero_grad()
    completion_logprobs(model, mb)[0].sum().backward()
    together = emb.grad.clone()
    model.zero_grad()
    for r in range(mb.input_ids.shape[0]):
        one = build_micro_batch([0], [mb.input_ids[r, :mb.prompt_len][mb.attention_mask[r, :mb.prompt_len].bool()].tolist()],
                                mb.targets[r:r + 1], mb.mask[r:r + 1], tok.pad_token_id)
        completion_logprobs(model, one)[0].sum().backward()
    torch.testing.assert_close(emb.grad, together, atol=1e-10, rtol=1e-8)


def test_lean_forward_steps_aside_where_it_would_be_wrong():
    tok, model = _model("qwen2")
    mb = _batch(tok)
    att, P = mb.attention_mask, mb.prompt_len
    # forward hooks on the decoder (reference dropout): the model's forward must run, so they act
    with hidden_dropout(model, 0.5):
        assert not uses_lean_forward(model, att, P)
        torch.manual_seed(0)
        dropped, _ = completion_logprobs(model, mb)
    plain, _ = completion_logprobs(model, mb)
    assert not torch.allclose(dropped, plain)
    assert uses_lean_forward(model, att, P)
    # an empty prompt row
    assert not uses_lean_forward(model, torch.zeros_like(att), P)
    # attention dropout in training mode
    model.config.attention_dropout = 0.1
    model.train()
    assert not lean.supports(model)
    model.eval()
    assert lean.supports(model)
    # gradient checkpointing: transformers' forward checkpoints its layers
    model.gradient_checkpointing_enable()
    assert not uses_lean_forward(model, att, P)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lora_wrapped_models_run_the_lean_forward_with_peft_s_result(arch):
    """A LoRA policy (adapters on every projection) on the lean path: the same log-probs and the
    same adapter gradients as peft's forward; with the adapters disabled (the KL reference), the
    base model's log-probs; LoRA dropout acting in training mode sends it back to peft's forward."""
    peft = pytest.importorskip("peft")
    tok, model = _model(arch)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=6, target_modules=targets))
    with torch.no_grad():                    # B starts at 0 (a no-op adapter): give it weight
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype))
    wrapped.eval()
    mb = _batch(tok)
    assert uses_lean_forward(wrapped, mb.attention_mask, mb.prompt_len)
    adapters = [p for n, p in wrapped.named_parameters() if "lora_" in n]

    def run():
        for p in adapters:
            p.grad = None
        got, _ = completion_logprobs(wrapped, mb)
        (got * torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)).sum().backward()
        return got.detach(), torch.cat([p.grad.flatten() for p in adapters])

    got, g_lean = run()
    with lean.disabled():
        want, g_peft = run()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g_lean, g_peft, atol=1e-10, rtol=1e-8)
    assert g_lean.abs().sum() > 0
    with torch.no_grad():
        with wrapped.disable_adapter():
            off, _ = completion_logprobs(wrapped, mb)
    with torch.no_grad(), wrapped.disable_adapter(), lean.disabled():
        base, _ = completion_logprobs(wrapped, mb)
    torch.testing.assert_close(off, base, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(off, got)                       # the adapters matter
    dropped = peft.get_peft_model(_model(arch)[1], peft.LoraConfig(r=2, target_modules=targets, lora_dropout=0.1))
    assert not uses_lean_forward(dropped.train(), mb.attention_mask, mb.prompt_len)
    assert uses_lean_forward(dropped.eval(), mb.attention_mask, mb.prompt_len)


def test_lora_over_a_bfloat16_base_runs_in_the_adapters_dtype():
    """peft keeps the adapters in float32 over a 16-bit base and casts the input to them; the lean
    forward does the same (no dtype error, peft's log-probs to bfloat16 rounding)."""
    peft = pytest.importorskip("peft")
    tok, model = _model("llama", dtype=torch.bfloat16)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    assert next(p for n, p in wrapped.named_parameters() if "lora_A" in n).dtype == torch.float32
    mb = _batch(tok)
    assert uses_lean_forward(wrapped, mb.attention_mask, mb.prompt_len)
    got, _ = completion_logprobs(wrapped, mb)
    with lean.disabled():
        want, _ = completion_logprobs(wrapped, mb)
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_padding_goes_through_no_projection(monkeypatch):
    """The layers' matmuls see each distinct prompt's real tokens once and the completion tokens fed
    (all but the last of a row), no padding: the rows of every projection's input are counted."""
    tok, model = _model("qwen2")
    mb = _batch(tok, L=5)
    seen = []
    real_linear = lean.linear

    def counting(x, w, b=None):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_linear(x, w, b)
    monkeypatch.setattr(lean, "linear", counting)
    completion_logprobs(model, mb)
    P = mb.prompt_len
    prompts = {tuple(mb.input_ids[r, :P][mb.attention_mask[r, :P].bool()].tolist()) for r in range(len(mb.rows))}
    fed = sum(len(p) for p in prompts) + int(mb.mask[:, :-1].sum())    # the last column predicts nothing
    padded = len(prompts) * P + mb.mask[:, :-1].numel()
    assert fed < padded                                   # the batch has padding to leave out
    assert set(seen) == {fed}


def _brute_force_cuts(lengths, P, call_cost, most):
    """Every way to cut the sorted rows into at most `most` runs: the least cost."""
    import itertools
    n = len(lengths)
    best = None
    for k in range(1, most + 1):
        for inner in itertools.combinations(range(1, n), k - 1):
            ends = [*inner, n]
            starts = [0, *inner]
            c = sum((e - s) * lengths[e - 1] * (P + lengths[e - 1]) + call_cost for s, e in zip(starts, ends))
            best = c if best is None else min(best, c)
    return best


def test_buckets_cut_rows_at_the_least_attention_cost():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lengths = sorted(torch.randint(1, 40, (n,), generator=g).tolist())
        P = int(torch.randint(1, 30, (1,), generator=g))
        call_cost = [0, 200, 4096][trial % 3]
        ends = lean.buckets(lengths, P, call_cost, most=3)
        assert ends[-1] == n and ends == sorted(set(ends))
        starts = [0, *ends[:-1]]
        got = sum((e - s) * lengths[e - 1] * (P + lengths[e - 1]) + call_cost for s, e in zip(starts, ends))
        assert got == _brute_force_cuts(lengths, P, call_cost, 3), (lengths, P, call_cost, ends)
    assert lean.buckets([5] * 6, 10, 0) == [6]                      # equal lengths: one call
    assert lean.buckets([1, 1, 1, 60], 10, 0) == [3, 4]             # one long row apart


@pytest.mark.parametrize("call_cost", [0, 30, None])
def test_completions_attended_in_buckets_equal_the_models_forward(monkeypatch, call_cost):
    """Rows of ragged lengths attended in one padded call or cut into buckets by length: the same
    log-probs and gradients as the model's own forward."""
    tok, model = _model("llama")
    a, b = (tok(p)["input_ids"] for p in ("12+34=", "5="))
    prompts = [a, a, b, a, b, b, a]
    L = 12
    lens = torch.tensor([12, 1, 3, 7, 12, 2, 5])
    comps = torch.randint(3, 12, (len(prompts), L), generator=torch.Generator().manual_seed(4))
    mask = (torch.arange(L)[None] < lens[:, None]).long()
    mb = build_micro_batch(list(range(len(prompts))), prompts, comps, mask, tok.pad_token_id)
    if call_cost is not None:                          # None: the default
        monkeypatch.setattr(lean, "CALL_COST", call_cost)
    calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(lean.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(a[0].shape) or real_sdpa(*a, **k))
    got, want, g_want = _both_paths(model, mb, 1.0, before_lean=calls.clear)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(_grads(model), g_want, atol=1e-10, rtol=1e-8)
    per_layer = len(calls) // len(model.model.layers)
    if call_cost == 0:             # fed lengths 1, 2, 3, 5, 7, 11, 11: the prompts, then 4 buckets
        assert per_layer == 1 + lean.MAX_BUCKETS, calls
        assert sorted(c[2] for c in calls[1:per_layer]) == [3, 5, 7, 11]
    if call_cost is None:
        assert per_layer == 2, calls                    # tiny rows: one call for the completions


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_completions_of_one_length_are_attended_in_place_with_the_models_result(monkeypatch, arch):
    """Every row fed to the same length (EOS ignored): the completions' queries, keys and values are
    views of the packed tensors (only the prompts' tokens are scattered into their padded layout),
    with the model's log-probs and gradients; ragged rows keep the scatter."""
    tok, model = _model(arch)
    a, b, c = (tok(p)["input_ids"] for p in ("12+34=", "5=", "9+9="))
    prompts = [a, b, a, c, b, a]
    L = 7
    comps = torch.randint(3, 12, (len(prompts), L), generator=torch.Generator().manual_seed(5))
    layouts = []
    real_layout = lean._layout
    monkeypatch.setattr(lean, "_layout", lambda *a: layouts.append(real_layout(*a)) or layouts[-1])
    for lens, direct in (([L] * len(prompts), True), ([L, 3, L, L, 5, L], False)):
        mask = (torch.arange(L)[None] < torch.tensor(lens)[:, None]).long()
        mb = build_micro_batch(list(range(len(prompts))), prompts, comps, mask, tok.pad_token_id)
        layouts.clear()
        got, want, g_want = _both_paths(model, mb, 0.8)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(_grads(model), g_want, atol=1e-10, rtol=1e-8)
        assert [lay.direct is not None for lay in layouts] == [direct], lens
        if direct:                                     # the prompts' real tokens: 6 + 2 + 4
            assert layouts[0].direct == 12
