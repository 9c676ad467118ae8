"""A tiny chat model taught, in a few seconds, to call the calculator tool: for "What is A*B?" its
greedy first turn is the hermes call, and after the tool's answer its second turn is the number.
Engines' multi-turn episodes are compared on it (tests/rollout/test_served_episodes.py and the vLLM
tier), so that the comparison covers tool calls, observations and several turns."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpokit.rollout.episodes.chat import ChatTokens
from grpokit.rollout.episodes.env import EnvSpec
from grpokit.tasks.tiny import build_chat_tokenizer, build_tiny_model, save_pretrained
from grpokit.train.logprobs import build_micro_batch, completion_logprobs

CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=?.,:;()[]{}<>!'\"#_\n|"
PAIRS = [(12, 3), (7, 8), (21, 4), (5, 9), (11, 6), (3, 14)]


class Calculator:
    """The calculator environment the model was taught to call."""

    def reset(self, **row):
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: digits and + - *, e.g. 12*3
        """
        if not set(expression) <= set("0123456789+-* ()"):
            raise ValueError("only digits, + - * and parentheses")
        return str(eval(expression, {"__builtins__": {}}))    # noqa: S307 - checked above


def call_text(a: int, b: int) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + f"{a}*{b}" + '"}}\n</tool_call>'


def rows() -> list[dict]:
    return [{"prompt": f"What is {a}*{b}?", "answer": a * b} for a, b in PAIRS]


def build(root: Path, steps: int = 60, hidden: int = 64) -> Path:
    """Save the taught model (and its tokenizer) under `root` and return its directory (`hidden`
    128 gives vLLM's attention backends the head size 64 they all support)."""
    torch.manual_seed(0)
    tok = build_chat_tokenizer(CHARS)
    model = build_tiny_model(tok, hidden=hidden, layers=2, heads=2, intermediate=2 * hidden, max_positions=1024)
    chat = ChatTokens(tok, EnvSpec(Calculator).schemas, [tok.eos_token_id])
    prompts, targets = [], []
    for a, b in PAIRS:
        user = [{"role": "user", "content": f"What is {a}*{b}?"}]
        first = tok(call_text(a, b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompts.append(chat.prompt_ids(user))
        targets.append(first)
        said = user + [{"role": "assistant", "content": call_text(a, b)}]
        obs = chat.observations([("calculator", str(a * b))])
        prompts.append(chat.prompt_ids(said + obs))
        targets.append(tok(str(a * b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    L = max(len(t) for t in targets)
    ids = torch.full((len(targets), L), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(targets), L), dtype=torch.long)
    for i, t in enumerate(targets):
        ids[i, :len(t)] = torch.tensor(t)
        mask[i, :len(t)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3 * 64 / hidden)
    mb = build_micro_batch(list(range(len(targets))), prompts, ids, mask, tok.pad_token_id)
    model.train()
    for _ in range(steps):
        logp, _ = completion_logprobs(model, mb)
        loss = -(logp * mb.mask).sum() / mb.mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    model.eval()
    out = save_pretrained(model, tok, root / "tool_model")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return out
