"""The token layer of an episode: what the policy is trained on is exactly what it sampled, plus
the chat template's tokens around each observation.

An episode's ids are built by appending, never by re-tokenizing the conversation: each assistant
turn keeps the engine's ids and log-probs as generated (its end-of-turn token included); each
observation is appended as the template's *delta*, the text the template adds between the history
so far and the history with the observation and the next assistant header, tokenized alone
(`observation_ids`). So a turn whose text would decode and re-encode to other ids (a space merged
into the next token, a `\\n` after the end-of-turn token that the model never generated) is kept as
sampled, and the log-probs the loss compares are those of the tokens the model actually produced.

This is exact only for templates that render a history the same whether or not more turns follow
(prefix-preserving). `prefix_preserving()` checks it on a probe conversation at the start of a run.
A template that rewrites earlier turns (some thinking templates drop earlier reasoning) is never
silently re-tokenized: the runner either refuses it or, as asked, trains each assistant turn as its
own segment with the prompt the engine was given for it (grpokit.rollout.episodes.runner).
"""

from __future__ import annotations

import json
import os

from grpokit.errors import ConfigError

SENTINEL = "GRPOKIT-TURN-SENTINEL"


class NotPrefixPreserving(ValueError):
    """The template rendered an earlier part of the conversation differently once more was appended."""


def tool_prompt(schemas: list[dict]) -> str:
    """The instructions given in the system message when the chat template does not render tools."""
    lines = "\n".join(json.dumps(s["function"]) for s in schemas)
    return ("You can use these tools, each described by a JSON schema:\n<tools>\n" + lines + "\n</tools>\n"
            "To use a tool, answer with only\n<tool_call>\n{\"name\": \"TOOL\", \"arguments\": {...}}\n</tool_call>\n"
            "Its result comes back in the next message. When you know the final answer, give it without a tool call.")


class ChatTokens:
    """Renders and tokenizes an episode's conversation with `tokenizer`'s chat template, offering
    `schemas` as tools (in the template's own way when it renders tools, else in a system message)."""

    def __init__(self, tokenizer, schemas: list[dict] | None = None, eos_ids: list[int] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("multi-turn episodes need a tokenizer with a chat template (this one has none)")
        self.tok = tokenizer
        self.schemas = list(schemas or [])
        self.native_tools = bool(self.schemas) and self._renders_tools()
        self.tool_role = self._tool_role()
        eos = eos_ids if eos_ids is not None else [tokenizer.eos_token_id]
        suffix = self._assistant_suffix()
        # what follows a turn that ended with end-of-turn token e: the rest of the template's suffix
        self.tails = {}
        for e in eos:
            text = tokenizer.decode([e])
            self.tails[e] = suffix[len(text):] if suffix.startswith(text) else suffix

    # ------------------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        msgs = list(messages)
        kw = {}
        if self.schemas and self.native_tools:
            kw["tools"] = self.schemas
        elif self.schemas:
            if msgs and msgs[0].get("role") == "system":
                msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + tool_prompt(self.schemas)}
            else:
                msgs.insert(0, {"role": "system", "content": tool_prompt(self.schemas)})
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: the conversation so far and the assistant header."""
        return self.encode(self.render(messages, True))

    def observation_ids(self, history: list[dict], new: list[dict], end_id: int | None, *,
                        strict: bool = True) -> list[int]:
        """The ids to append after an assistant turn (the last message of `history`, which ended with
        token `end_id`) so that the sequence continues with the `new` messages and the next assistant
        header, exactly as the template renders them. `strict=False` (step-wise segments, where
        these ids are only counted and shown): a template that rewrites earlier turns gives the
        text after the part both renderings share."""
        before = self.render(history, False)
        after = self.render(history + new, True)
        if not after.startswith(before):
            if strict:
                raise NotPrefixPreserving("the chat template rendered the earlier turns differently once an "
                                          "observation was appended")
            before = os.path.commonprefix([before, after])
        text = (self.tails.get(end_id, "") if end_id is not None else "") + after[len(before):]
        if end_id is not None:                       # a template that ends the last turn only once more follows
            end = self.tok.decode([end_id])
            if end and text.startswith(end):
                text = text[len(end):]
        missing = [m["content"] for m in new if strict and m.get("content") and m["content"].strip() not in text]
        if missing:
            raise NotPrefixPreserving(f"the chat template dropped an observation ({missing[0][:60]!r}) from the "
                                      "conversation")
        return self.encode(text)

    def observation(self, content: str, name: str | None = None) -> dict:
        """A tool's answer as a message of the role the template accepts."""
        if self.tool_role == "tool":
            return {"role": "tool", "content": content, **({"name": name} if name else {})}
        return {"role": "user", "content": f"Tool result{f' ({name})' if name else ''}: {content}"}

    def observations(self, results: list[tuple[str | None, str]]) -> list[dict]:
        """The messages of one turn's (tool name, answer) pairs: one per call with a `tool` role,
        else one user message holding them all (templates that want user and assistant to
        alternate refuse two user turns in a row)."""
        msgs = [self.observation(text, name) for name, text in results]
        if self.tool_role == "tool" or len(msgs) < 2:
            return msgs
        return [{"role": "user", "content": "\n\n".join(m["content"] for m in msgs)}]

    # ------------------------------------------------------------------------------ checks
    def prefix_preserving(self) -> bool:
        """True when rendering a probe conversation turn by turn only ever appends (the condition
        for appending deltas to be exact)."""
        call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        convo = [{"role": "user", "content": "What is 2 + 3?"},
                 {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n" + call},
                 self.observation("5", "f"),
                 {"role": "assistant", "content": "<think>\ndone\n</think>\n\nThe answer is 5."},
                 {"role": "user", "content": "And 5 + 1?"}]
        try:
            for k in (2, 4):
                before, after = self.render(convo[:k], False), self.render(convo[:k + 1], True)
                if not after.startswith(before):
                    return False
        except Exception:  # noqa: BLE001 - a template that cannot render the probe is not usable
            return False
        return True

    def _renders_tools(self) -> bool:
        probe = [{"role": "user", "content": "hi"}]
        try:
            with_tools = self.tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, tools=self.schemas)
        except Exception:  # noqa: BLE001 - a template without tool support may raise
            return False
        return with_tools != self.tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)

    def _tool_role(self) -> str:
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
                 {"role": "tool", "content": SENTINEL}]
        try:
            text = self.tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - the template refuses the role
            return "user"
        return "tool" if SENTINEL in text else "user"

    def _assistant_suffix(self) -> str:
        """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}]
        text = self.tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
        at = text.rfind(SENTINEL)
        return text[at + len(SENTINEL):] if at >= 0 else ""

