"""Loading local Hugging Face causal LMs and tokenizers (nothing is ever downloaded).

A leaf: imports nothing else of grpokit. Directories holding LoRA adapters alone are loaded by
`grpokit.models.load_model` / `load_tokenizer` (grpokit.models.loading), which dispatch here or to
grpokit.models.lora."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# Belt and braces: a run must never reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}
ROUND_TRIP_PROBE = "Answer: 12 + 7 = 19. (x, y) -> [a-b]\n"


class ModelLoadError(ValueError):
    """A one-line, user-facing model loading error."""


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _check_dir(path: str | Path) -> Path:
    p = Path(path)
    if not str(path):
        raise ModelLoadError("no model path given (set model.path to a local Hugging Face model directory)")
    if not p.is_dir():
        raise ModelLoadError(f"model directory not found: {p} (grpokit never downloads models; give a local path)")
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise ModelLoadError(f"{p}: not a Hugging Face model directory (no config.json)")
    return p


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False):
    """Load the tokenizer saved in `path`, exactly as it was saved.

    transformers 5 may map a model type (e.g. `qwen2`) to that family's tokenizer class even when
    the directory holds a generic `tokenizers` tokenizer, which changes how text is split and
    decoded. When `tokenizer_config.json` names a generic class we load that class directly.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = _check_dir(path)
    if not (p / "tokenizer_config.json").is_file() and (p / "adapter_config.json").is_file():
        raise ModelLoadError(f"{p}: LoRA adapters without a tokenizer (load them with grpokit.models.load_tokenizer)")
    cfg_file = p / "tokenizer_config.json"
    saved_class = json.loads(cfg_file.read_text()).get("tokenizer_class") if cfg_file.is_file() else None
    if saved_class in _GENERIC_TOKENIZERS and (p / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"{p}: the tokenizer has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_round_trip(tokenizer, texts: list[str]) -> None:
    """Raise if decode(encode(text)) loses characters (a silently wrong tokenizer)."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if back.strip() != text.strip():
            raise ModelLoadError(f"the tokenizer does not round-trip: {text[:60]!r} -> {back[:60]!r}")


def load_model(path: str | Path, *, dtype: str = "auto", device: str = "auto",
               gradient_checkpointing: bool = False, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    p = _check_dir(path)
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p}: LoRA adapters alone, not a model (load them with grpokit.models.load_model)")
    dev = resolve_device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, dtype=resolve_dtype(dtype, dev), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{p}: cannot load the model ({str(exc).splitlines()[0]})") from None
    model.to(dev)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def count_parameters(model, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
