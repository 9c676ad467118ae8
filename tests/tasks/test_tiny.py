"""The on-the-spot tokenizer and tiny models: round trips through the Hugging Face loaders."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained


def test_char_tokenizer_is_one_token_per_character_and_round_trips():
    tok = build_char_tokenizer("0123456789+=")
    ids = tok("12+30=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "12+30="
    assert tok.padding_side == "left" and tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok("x")["input_ids"] == [tok.unk_token_id]          # unknown characters map to <unk>


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_saved_model_and_tokenizer_load_back_identically(tmp_path, arch):
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, arch=arch, hidden=32, layers=2, heads=4, kv_heads=2, seed=4).eval()
    save_pretrained(model, tok, tmp_path / "m")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "m")
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(model2) is type(model) and tok2("47+38=")["input_ids"] == tok("47+38=")["input_ids"]
    x = torch.tensor([tok("47+38=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model2(x).logits, model(x).logits)


def test_the_seed_fixes_the_weights_and_leaves_the_global_rng_alone():
    tok = build_char_tokenizer("0123456789")
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a = build_tiny_model(tok, hidden=32, layers=1, seed=1)
    after = torch.rand(1)
    b = build_tiny_model(tok, hidden=32, layers=1, seed=1)
    c = build_tiny_model(tok, hidden=32, layers=1, seed=2)
    assert torch.equal(before, after)
    sd_a, sd_b, sd_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not all(torch.equal(sd_a[k], sd_c[k]) for k in sd_a)


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tiny-model architecture 'gpt2'"):
        build_tiny_model(build_char_tokenizer("01"), arch="gpt2")
