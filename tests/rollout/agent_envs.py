"""Environments importable by name from a config (`rollout.env: tests.rollout.agent_envs:...`)."""

from __future__ import annotations


class AgainEnv:
    """The text form: answers every turn with "again" (so episodes always run to rollout.agent.max_turns)."""

    def reset(self, **row):
        self.seen = []
        return None

    def step(self, text: str):
        self.seen.append(text)
        return "again"

    def reward(self) -> float:
        return float(sum(len(t) for t in self.seen) % 3)


class CalcEnv:
    """A calculator tool."""

    def reset(self, **row):
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: digits and + - *, e.g. 12*3
        """
        allowed = set("0123456789+-* ()")
        if not set(expression) <= allowed:
            raise ValueError("only digits, + - * and parentheses")
        return str(eval(expression, {"__builtins__": {}}))    # noqa: S307 - checked above


def two_turn_loop(engine, row):
    """A user-owned agent loop (`rollout.agent.loop`): a turn, an observation it writes itself, a
    second turn; one trajectory with the observation masked."""
    from grpokit.rollout.episodes import Trajectory

    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": str(row["prompt"])}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else list(prompt["input_ids"])
    first = engine.generate(prompt, max_new_tokens=12)
    obs = tok("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    second = engine.generate(prompt + first.ids + obs, max_new_tokens=12)
    return Trajectory(prompt_ids=prompt, ids=first.ids + obs + second.ids,
                      mask=[1] * len(first.ids) + [0] * len(obs) + [1] * len(second.ids),
                      logprobs=first.logprobs + [0.0] * len(obs) + second.logprobs,
                      completion=tok.decode(second.ids, skip_special_tokens=True), reward=float(sum(first.ids) % 3),
                      info={"tool_calls": 1})
