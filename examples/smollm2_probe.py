"""What a trained SmolLM2 policy can and cannot do, beyond its greedy pass@1 (docs/example.md).

    python examples/smollm2_probe.py MODEL_DIR [--data runs/example/data/heldout.jsonl] [--k 8]

(the second measurement generates with transformers, prompt by prompt: minutes for a trained
policy, ten or more for the base model, whose answers run to the 64-token limit; `--k 0` skips it)

MODEL_DIR: the converted base model (~/.cache/grpokit/gguf/<hash>) or a checkpoint of a run
(RUN_DIR/grpo/checkpoints/step_N). Two measurements on the held-out split:

1. **Direct arithmetic.** For every "What is <expression>?" problem, the assistant's answer is
   forced to begin with "<expression> = \\boxed{" and the greedy continuation up to "}" is compared
   with the answer, split by two and three operands. This separates arithmetic from format: the
   recipe's runs end up answering in exactly this form.
2. **pass@k and mean@k** at a temperature (default 1.0) with the recipe's `math_accuracy`, beside
   greedy pass@1: how much a further round of GRPO could still find, and the fraction of prompts
   whose k answers are mixed (the groups that carry signal).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from grpokit.rewards import get

EXPR = re.compile(r"What is ([\d +-]+)\?")


def direct_arithmetic(model, tok, rows: list[dict]) -> dict[str, list[int]]:
    """{"two": [right, total], "three": [right, total]} with the answer forced into the box."""
    out = {"two": [0, 0], "three": [0, 0]}
    for r in rows:
        m = EXPR.search(r["prompt"][-1]["content"])
        if not m:
            continue
        expr = m.group(1).strip()
        text = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tok(text + f"{expr} = \\boxed{{", return_tensors="pt").input_ids
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        said = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).split("}")[0].strip()
        kind = "three" if len(re.findall(r"[+-]", expr)) == 2 else "two"
        out[kind][0] += said == str(r["answer"])
        out[kind][1] += 1
    return out


def sampled(model, tok, rows: list[dict], k: int, temperature: float, seed: int) -> dict[str, float]:
    """Greedy pass@1, pass@k and mean@k with `math_accuracy` (boxed, else last stated answer)."""
    score = get("math_accuracy")
    torch.manual_seed(seed)
    greedy, any_right, mean, mixed = 0, 0, 0.0, 0
    for r in rows:
        text = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        att = torch.ones_like(ids)
        g = model.generate(ids, attention_mask=att, max_new_tokens=64, do_sample=False)
        s = model.generate(ids.repeat(k, 1), attention_mask=att.repeat(k, 1), max_new_tokens=64,
                           do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        texts = [tok.decode(x[ids.shape[1]:], skip_special_tokens=True) for x in [*g, *s]]
        hits = [v is not None and v >= 1.0 for v in score([text] * (k + 1), texts, answer=[r["answer"]] * (k + 1))]
        greedy += hits[0]
        any_right += any(hits[1:])
        mean += sum(hits[1:]) / k
        mixed += any(hits[1:]) and not all(hits[1:])
    n = max(len(rows), 1)
    return {"greedy_pass@1": greedy / n, f"pass@{k}": any_right / n, f"mean@{k}": mean / n,
            "mixed_frac": mixed / n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a converted model or checkpoint directory")
    p.add_argument("--data", default="runs/example/data/heldout.jsonl")
    p.add_argument("--k", type=int, default=8, help="samples per prompt (0: direct arithmetic only)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for path, what in ((Path(args.model), "model"), (Path(args.data), "data file")):
        if not path.exists():
            p.error(f"{what} not found: {path}")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    with torch.no_grad():
        result = {"direct_arithmetic": direct_arithmetic(model, tok, rows)}
        if args.k > 0:
            result.update(sampled(model, tok, rows, args.k, args.temperature, args.seed))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
