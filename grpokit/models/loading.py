"""One entry point for loading a model or tokenizer from a path: a plain Hugging Face directory
(grpokit.models.hf), a directory of LoRA adapters (their base + the adapters, grpokit.models.lora),
or a GGUF file converted once into a cached plain directory (grpokit.models.gguf). A sharded (DCP)
checkpoint is refused with the command that exports it (grpokit.models.sharded).

Used by training (grpokit.train.build) and by rollout/serving alike; imports nothing from
grpokit.train or grpokit.rollout.
"""

from __future__ import annotations

from pathlib import Path

from grpokit.models import gguf, hf, lora, sharded
from grpokit.models.hf import ModelLoadError, _check_dir


def _is_adapter_dir(p: Path) -> bool:
    return not (p / "config.json").is_file() and (p / "adapter_config.json").is_file()


def load_model(path: str | Path, *, dtype: str = "auto", device: str = "auto",
               gradient_checkpointing: bool = False, trust_remote_code: bool = False, gguf_file: str = ""):
    """A local model directory, a directory of LoRA adapters (their base + the adapters), or a GGUF
    file (`path` itself, or `gguf_file` inside the directory `path`) through its cached conversion."""
    p = _check_dir(gguf.resolve_model_dir(path, gguf_file))
    if sharded.is_sharded(p):
        raise ModelLoadError(f"{p} is a sharded checkpoint (an FSDP2 run's): write a plain model "
                                       f"with `grpokit export {p} OUT_DIR` and load OUT_DIR")
    if _is_adapter_dir(p):
        return lora.load_adapter_model(p, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    return hf.load_model(p, dtype=dtype, device=device, gradient_checkpointing=gradient_checkpointing,
                         trust_remote_code=trust_remote_code)


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False, gguf_file: str = ""):
    """The tokenizer of a model directory, of the base of an adapters-only directory, or of a GGUF
    file's cached conversion."""
    p = _check_dir(gguf.resolve_model_dir(path, gguf_file))
    if not (p / "tokenizer_config.json").is_file() and (p / "adapter_config.json").is_file():
        p = lora.resolve_base(p)            # LoRA adapters saved without a tokenizer: the base's
    return hf.load_tokenizer(p, trust_remote_code=trust_remote_code)
