"""Agent code written for the OpenAI API, trained as it is (`rollout.agent: tests.rollout.openai_agents:...`)."""

from __future__ import annotations

import json

from grpokit.rollout.episodes import EnvSpec
from tests.rollout.tool_model import Calculator

TOOLS = EnvSpec(Calculator).schemas       # the schema the tiny model was taught with


async def calculator_agent(client, row):
    """Ask, run the tool calls the model makes, answer them, until it answers without one."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="grpokit-policy", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        for call in msg.tool_calls:
            try:
                value = Calculator().calculator(**json.loads(call.function.arguments))
            except Exception as exc:  # noqa: BLE001 - the agent tells the model (in grpokit's own words)
                value = f"tool {call.function.name} failed: {type(exc).__name__}: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
    return None


async def scored_agent(client, row):
    """One call; its own reward: 1.0 when the answer holds a digit."""
    reply = await client.chat.completions.create(model="grpokit-policy",
                                                 messages=[{"role": "user", "content": row["prompt"]}])
    return float(any(ch.isdigit() for ch in reply.choices[0].message.content or ""))
