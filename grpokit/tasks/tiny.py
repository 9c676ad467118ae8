"""A character-level tokenizer and tiny Qwen2/Llama models built on the spot (nothing downloaded).

The tokenizer is a `tokenizers` WordLevel model over single characters (every character is its own
pre-token, decoding fuses them back with no separator), wrapped in `PreTrainedTokenizerFast`, so it
saves and loads through `AutoTokenizer` like any Hugging Face tokenizer. `tokenizer_class` is written
explicitly so that loading a `qwen2` model directory never substitutes Qwen's BPE tokenizer class.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
DEFAULT_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=?.,:;()[]{}<>!'\"#_\n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS):
    """Return a `PreTrainedTokenizerFast` with one token per character of `chars` plus 4 specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, BOS, UNK]
    uniq = list(dict.fromkeys(chars))
    vocab = {tok: i for i, tok in enumerate(specials + uniq)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    fast.padding_side = "left"
    return fast


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_chat_tokenizer(chars: str = DEFAULT_CHARS, words: tuple[str, ...] = ()):
    """A character tokenizer with ChatML turns: `<|im_start|>` and `<|im_end|>` (the end-of-turn
    and EOS token) as special tokens and a ChatML chat template. `words`: extra multi-character
    tokens that decoding produces but encoding never does (text splits into characters), to make
    a decode -> encode round trip change the ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, "<|im_end|>", BOS, UNK, "<|im_start|>"]
    uniq = list(dict.fromkeys(chars)) + [w for w in words if len(w) > 1]
    vocab = {tok: i for i, tok in enumerate(specials + uniq)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token="<|im_end|>", bos_token=BOS, unk_token=UNK,
        additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    fast.padding_side = "left"
    fast.chat_template = CHATML
    return fast


def build_tiny_model(tokenizer, *, arch: str = "qwen2", hidden: int = 128, layers: int = 4,
                     heads: int = 4, kv_heads: int | None = None, intermediate: int | None = None,
                     max_positions: int = 256, tie_embeddings: bool = True, seed: int = 0):
    """A randomly initialised (seeded) Qwen2- or Llama-architecture causal LM for `tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if arch not in classes:
        raise ValueError(f"unknown tiny-model architecture {arch!r}; choose one of {sorted(classes)}")
    config_cls, model_cls = classes[arch]
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        intermediate_size=intermediate or 4 * hidden, max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_pretrained(model, tokenizer, path: str | Path) -> Path:
    """Save model and tokenizer as a plain Hugging Face directory (safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
