"""Tool calls in an assistant turn's text, in the hermes format that Qwen2.5/3, SmolLM3, Hermes
and most tool-tuned open models emit (and that grpokit's tool prompt asks of models whose chat
template has no tools of its own):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

A turn holds zero or more calls. A turn that opens `<tool_call>` but does not close it, or whose
body is not a JSON object with a string `name` and an object `arguments` (a JSON string holding an
object is accepted too), is a parse failure: the model is told what was wrong, and the failure is
counted (`agent/parse_failures`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None
    """Why a call could not be read (None: every opened call parsed)."""

    @property
    def has_call(self) -> bool:
        return bool(self.calls) or self.error is not None


def parse_tool_calls(text: str) -> Parsed:
    """The hermes-format tool calls of `text`, in order."""
    out = Parsed()
    bodies = _CALL.findall(text)
    if text.count(OPEN) > len(bodies):
        out.error = f"a {OPEN} was not closed with {CLOSE}"
        return out
    for body in bodies:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            out.error = f"the tool call is not JSON ({exc.msg} at character {exc.pos})"
            return out
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.error = 'a tool call is a JSON object {"name": ..., "arguments": {...}}'
            return out
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.error = f'the "arguments" of {obj["name"]} must be a JSON object'
            return out
        out.calls.append(ToolCall(obj["name"], args))
    return out
