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
