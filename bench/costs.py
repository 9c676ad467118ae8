"""What two cuts of the memory order cost on this machine (`make bench-costs`), the figures the
planner states (grpokit/train/memory.py: CKPT_SLOWDOWN, FOUR_BIT_DLOGP; docs/memory.md):

- gradient checkpointing: forward + backward time of an 8.4 M-parameter Qwen2 (hidden 256, 8
  layers) on 16 x 256 tokens, with and without it (best of 3 after a warm-up round);
- 4-bit base weights: a 4.2 M-parameter Qwen2 (hidden 256, 4 layers) warm-started for 200
  supervised steps on the demo's task, its per-token log-probs of 64 right sums in float32 and in
  NF4 (double quantisation, bitsandbytes on the CPU): mean, p99 and max |difference|, and the KL
  between the two next-token distributions.

Prints one JSON object. Several minutes on 2 cores (bitsandbytes' 4-bit CPU path is the slow part).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch


def checkpointing_slowdown() -> dict:
    from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    m = build_tiny_model(tok, hidden=256, layers=8, heads=8, max_positions=512, seed=0)
    ids = torch.randint(4, len(tok), (16, 256))
    out = {"params_M": sum(p.numel() for p in m.parameters()) / 1e6}
    for ckpt in (False, True):
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_disable()
        m.train()
        times = []
        for _ in range(4):
            t = time.perf_counter()
            m(input_ids=ids, use_cache=False).logits.float().log_softmax(-1).mean().backward()
            m.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
        out[f"fwd_bwd_s_ckpt_{ckpt}".lower()] = min(times[1:])
    out["slowdown"] = out["fwd_bwd_s_ckpt_true"] / out["fwd_bwd_s_ckpt_false"] - 1
    return out


def four_bit_error() -> dict:
    from grpokit.config import load_config
    from grpokit.models.lora import four_bit_unavailable, load_4bit_model
    from grpokit.tasks.arithmetic import ArithmeticTask
    from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model, save_pretrained
    from grpokit.train.sft import sft

    missing = four_bit_unavailable("cpu")
    if missing:
        return {"skipped": missing}
    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, hidden=256, layers=4, heads=8, max_positions=64, seed=0)
    task, teacher = ArithmeticTask(seed=0), random.Random(1)
    sft(model, tok, lambda n, rng: [(f"{a}+{b}=", task.teacher(a, b, teacher)) for a, b in task.draw(n, rng)],
        steps=200, lr=2e-3, seed=0)
    path = Path(tempfile.mkdtemp()) / "m"
    save_pretrained(model, tok, path)
    lora = load_config(None, ["lora.enabled=true", "lora.load_in_4bit=true"]).lora
    q = load_4bit_model(path, lora, dtype="float32", device="cpu")
    texts = [t for t in (f"{a}+{b}={a + b}" for a, b in task.draw(200, random.Random(7))) if len(t) == 9][:64]
    ids = torch.tensor([tok.encode(t) for t in texts])
    with torch.no_grad():
        full = model.eval()(input_ids=ids).logits.float().log_softmax(-1)
        four = q.eval()(input_ids=ids).logits.float().log_softmax(-1)
    target = ids[:, 1:, None]
    diff = (full[:, :-1].gather(-1, target) - four[:, :-1].gather(-1, target)).abs().flatten()
    return {"params_M": sum(p.numel() for p in model.parameters()) / 1e6, "mean_abs_dlogp": float(diff.mean()),
            "p99_abs_dlogp": float(diff.quantile(0.99)), "max_abs_dlogp": float(diff.max()),
            "kl_full_vs_4bit": float((full.exp() * (full - four)).sum(-1).mean())}


def main() -> None:
    print(json.dumps({"gradient_checkpointing": checkpointing_slowdown(), "four_bit": four_bit_error(),
                      "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
