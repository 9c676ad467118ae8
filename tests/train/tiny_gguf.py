"""A tiny Llama GGUF file written with the `gguf` package, for tests of the GGUF loader.

Random float32 weights (2 layers, hidden 32, 4 query / 2 KV heads) and a byte-level BPE
vocabulary (the 256 byte symbols, a few merges, ChatML control tokens and a chat template), laid out
under llama.cpp's tensor and metadata names so transformers reads it as it reads a real file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "Ġ a", "h e", "i n"]


def _vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    return SPECIALS + symbols + ["".join(m.split(" ")) for m in MERGES]


def write_tiny_gguf(path: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 64) -> Path:
    import gguf

    path = Path(path)
    tokens = _vocab()
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", w(len(tokens), hidden))
    for i in range(layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", 1 + w(hidden))
        writer.add_tensor(b + "attn_q.weight", w(heads * head_dim, hidden))
        writer.add_tensor(b + "attn_k.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_v.weight", w(kv_heads * head_dim, hidden))
        writer.add_tensor(b + "attn_output.weight", w(hidden, heads * head_dim))
        writer.add_tensor(b + "ffn_norm.weight", 1 + w(hidden))
        writer.add_tensor(b + "ffn_gate.weight", w(ffn, hidden))
        writer.add_tensor(b + "ffn_up.weight", w(ffn, hidden))
        writer.add_tensor(b + "ffn_down.weight", w(hidden, ffn))
    writer.add_tensor("output_norm.weight", 1 + w(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
