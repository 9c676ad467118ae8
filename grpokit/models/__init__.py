"""Models: loading local Hugging Face directories (grpokit.models.hf), LoRA / QLoRA adapters and
merged saves (grpokit.models.lora), GGUF files (grpokit.models.gguf), sharded DCP checkpoints
(grpokit.models.sharded), and the loaders that choose between them (grpokit.models.loading).

Shared by training and rollout: nothing here imports grpokit.train or grpokit.rollout."""

from __future__ import annotations

from grpokit.models.hf import ModelLoadError
from grpokit.models.loading import load_model, load_tokenizer

__all__ = ["ModelLoadError", "load_model", "load_tokenizer"]
