"""The lean decoding path (grpokit.rollout.decoder) against the model's own forward."""

import pytest
import torch

from grpokit.rollout.base import SamplingParams
from grpokit.rollout.decoder import LeanDecoder
from grpokit.rollout.hf import HFEngine
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train.logprobs import build_micro_batch, completion_logprobs

PROMPTS = ["12+3=", "7+80=", "1=", "45+45="]          # different lengths: left padding


def _model(arch="qwen2", eos_boost=0.0, kv_heads=None):
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, arch=arch, hidden=32, layers=2, heads=4, kv_heads=kv_heads, intermediate=64,
                             max_positions=64, seed=3)
    if eos_boost:       # make EOS likely, so that rows finish at different steps and leave the batch
        with torch.no_grad():
            model.get_output_embeddings().weight[tok.eos_token_id] *= 0
            model.model.norm.weight += 0.0
            model.get_output_embeddings().weight[tok.eos_token_id] += eos_boost * model.model.embed_tokens.weight.mean(0)
    model.eval()
    return model, tok


@pytest.mark.parametrize("arch,kv_heads", [("qwen2", None), ("llama", 2)])
def test_lean_greedy_equals_the_models_own_forward(arch, kv_heads):
    model, tok = _model(arch, kv_heads=kv_heads)
    assert LeanDecoder.supports(model)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=3, max_new_tokens=12, temperature=0)
    lean = HFEngine(model, tok, lean=True).generate(ids, params)
    plain = HFEngine(model, tok, lean=False).generate(ids, params)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert lean.finish_reason == plain.finish_reason
    torch.testing.assert_close(lean.sampler_logprobs, plain.sampler_logprobs, atol=2e-5, rtol=1e-4)


def test_lean_sampling_with_rows_leaving_the_batch():
    model, tok = _model(eos_boost=3.0)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    batch = HFEngine(model, tok).generate(ids, SamplingParams(n=8, max_new_tokens=16, temperature=1.0),
                                          torch.Generator().manual_seed(0))
    lengths = batch.lengths
    assert len(set(lengths.tolist())) > 3 and "eos" in batch.finish_reason      # ragged, some rows ended early
    for i, fr in enumerate(batch.finish_reason):
        n = int(lengths[i])
        assert (batch.completion_ids[i, n - 1].item() == tok.eos_token_id) == (fr == "eos")
        assert tok.eos_token_id not in batch.completion_ids[i, :n - 1].tolist()
        assert (batch.completion_ids[i, n:] == tok.pad_token_id).all()
    mb = build_micro_batch(list(range(len(batch))), batch.prompt_ids, batch.completion_ids, batch.completion_mask,
                           tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, mb, temperature=1.0)
    assert torch.isfinite(batch.sampler_logprobs).all()
    assert (batch.sampler_logprobs[batch.completion_mask == 0] == 0).all()          # past a row's end: exactly 0
    torch.testing.assert_close(lp * mb.mask, batch.sampler_logprobs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("lean", [True, False])
def test_every_sample_leaves_zero_past_its_end(lean):
    """Columns after a row's EOS are pad / 0 whatever the sampling: many seeds, rows ending at every step."""
    model, tok = _model(eos_boost=3.0)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    engine = HFEngine(model, tok, lean=lean)
    for seed in range(100):
        batch = engine.generate(ids, SamplingParams(n=8, max_new_tokens=12, temperature=1.0),
                                torch.Generator().manual_seed(seed))
        past = batch.completion_mask == 0
        assert torch.isfinite(batch.sampler_logprobs).all(), seed
        assert (batch.sampler_logprobs[past] == 0).all() and (batch.completion_ids[past] == tok.pad_token_id).all()


def test_batch_assembly_ignores_whatever_lies_past_a_rows_end():
    model, tok = _model()
    engine = HFEngine(model, tok)
    tokens = torch.tensor([[5, tok.eos_token_id, 7, 7], [4, 4, 4, 4]])
    logps = torch.tensor([[-1.0, -2.0, float("nan"), -float("inf")], [-1.0, -1.0, -1.0, -1.0]])
    batch = engine._batch([[1]], 2, tokens, logps, torch.tensor([1, -1]), 0)
    assert batch.sampler_logprobs.tolist() == [[-1.0, -2.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]]
    assert batch.completion_ids[0].tolist() == [5, tok.eos_token_id, tok.pad_token_id, tok.pad_token_id]


@pytest.mark.parametrize("lean", [True, False])
def test_ignore_eos_runs_every_row_to_the_limit(lean):
    model, tok = _model(eos_boost=3.0)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    batch = HFEngine(model, tok, lean=lean).generate(
        ids, SamplingParams(n=4, max_new_tokens=10, temperature=1.0, ignore_eos=True), torch.Generator().manual_seed(0))
    assert batch.lengths.tolist() == [10] * 16 and set(batch.finish_reason) == {"length"}
    assert (batch.completion_ids == tok.eos_token_id).any()          # EOS was sampled and did not stop the row


def test_unsupported_models_fall_back():
    model, tok = _model()
    model.config.hidden_act = "gelu"
    assert not LeanDecoder.supports(model)


@pytest.mark.parametrize("lean", [True, False])
def test_prompt_streams_make_a_groups_samples_independent_of_its_batch(lean):
    """With one stream per prompt (`PromptStreams`), a prompt's completions are the same whether it
    is sampled alone or with others of different lengths, and in any position of the batch; with one
    generator for the batch they are not. float64, so padding cannot change a draw."""
    from grpokit.rollout.base import PromptStreams

    model, tok = _model(eos_boost=2.0)
    model = model.double()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=10, temperature=1.0)
    eng = HFEngine(model, tok, lean=lean)
    seeds = [11, 22, 33, 44]
    together = eng.generate(ids, params, PromptStreams(seeds))
    assert len(set(together.finish_reason)) == 2               # rows finished at different steps
    for j in (3, 1):
        alone = eng.generate([ids[j]], params, PromptStreams([seeds[j]]))
        rows = slice(4 * j, 4 * j + 4)
        assert alone.completions == together.completions[rows]
        torch.testing.assert_close(alone.sampler_logprobs, together.sampler_logprobs[rows, :alone.sampler_logprobs.shape[1]])
    reordered = eng.generate([ids[2], ids[0]], params, PromptStreams([seeds[2], seeds[0]]))
    assert reordered.completions == together.completions[8:12] + together.completions[0:4]
    shared = [eng.generate([ids[j]], params, torch.Generator().manual_seed(5)).completions for j in range(4)]
    assert sum(shared, []) != eng.generate(ids, params, torch.Generator().manual_seed(5)).completions
    with pytest.raises(ValueError, match="2 prompt streams for 4 prompts"):
        eng.generate(ids, params, PromptStreams([1, 2]))


def _lora(model, **kw):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"], **kw)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():             # peft starts B at 0 (the adapter is then a no-op): give it weight
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft_model.eval()


@pytest.mark.parametrize("arch,kv_heads", [("qwen2", None), ("llama", 2)])
def test_lean_decodes_a_lora_policy_as_peft_does(arch, kv_heads):
    """A LoRA policy decodes on the lean path with its adapters folded in: the same tokens and
    log-probs as peft's own forward, adapters on and off; the model is not modified."""
    base, tok = _model(arch, kv_heads=kv_heads)
    plain_base = HFEngine(base, tok, lean=False).generate([tok(p)["input_ids"] for p in PROMPTS],
                                                          SamplingParams(n=2, max_new_tokens=12, temperature=0))
    model = _lora(base)
    assert LeanDecoder.supports(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0)
    lean = HFEngine(model, tok, lean=True).generate(ids, params)
    plain = HFEngine(model, tok, lean=False).generate(ids, params)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    torch.testing.assert_close(lean.sampler_logprobs, plain.sampler_logprobs, atol=2e-5, rtol=1e-4)
    assert not torch.equal(lean.completion_ids, plain_base.completion_ids)    # the adapters change the answers
    with model.disable_adapter():
        off = HFEngine(model, tok, lean=True).generate(ids, params)
    assert torch.equal(off.completion_ids, plain_base.completion_ids)
    torch.testing.assert_close(off.sampler_logprobs, plain_base.sampler_logprobs, atol=2e-5, rtol=1e-4)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_lean_leaves_dora_to_the_models_own_forward():
    model, _ = _model()
    assert not LeanDecoder.supports(_lora(model, use_dora=True))



@pytest.mark.parametrize("extra", [{"target_modules": ["q_proj", "embed_tokens"]},
                                   {"target_modules": ["q_proj"], "modules_to_save": ["norm"]}])
def test_lean_leaves_adapted_embeddings_and_norms_to_the_models_own_forward(extra):
    """An adapter on the embedding, or a trainable copy of a norm, is not in the weights the lean
    decoder reads: such a model must take the model's own forward."""
    from peft import LoraConfig, get_peft_model

    model, _ = _model("llama", kv_heads=2)
    assert not LeanDecoder.supports(get_peft_model(model, LoraConfig(r=2, **extra)))


def test_a_lora_policy_samples_without_folded_copies_when_they_would_not_fit(monkeypatch):
    """Folding the adapters copies every adapted weight for the rollout; where those copies would
    take more than half the free memory, sampling goes through peft's forward (no copies), with the
    same tokens. A model without adapters is never held back."""
    from grpokit.rollout import decoder

    base, tok = _model("llama", kv_heads=2)
    plain_ok = LeanDecoder.folds_fit(base)
    model = _lora(base)
    assert plain_ok and LeanDecoder.folds_fit(model)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0)
    eng = HFEngine(model, tok)
    paths = []
    monkeypatch.setattr(eng, "_generate_lean", lambda *a: paths.append("lean") or HFEngine._generate_lean(eng, *a))
    monkeypatch.setattr(eng, "_generate", lambda *a: paths.append("model") or HFEngine._generate(eng, *a))
    roomy = eng.generate(ids, params)
    monkeypatch.setattr(decoder, "free_bytes", lambda device: 1000)     # ~the size of one adapted weight
    assert not LeanDecoder.folds_fit(model)
    with model.disable_adapter():                                      # nothing to fold
        assert LeanDecoder.folds_fit(model)
    tight = eng.generate(ids, params)
    assert paths == ["lean", "model"]
    assert torch.equal(roomy.completion_ids, tight.completion_ids)
