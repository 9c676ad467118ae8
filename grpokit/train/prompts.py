"""Turning dataset prompts (plain strings or chat messages) into token ids."""

from __future__ import annotations

from grpokit.errors import ConfigError


class PromptEncoder:
    """Encodes a prompt, applying the tokenizer's chat template where asked (`auto`: for chat
    messages when the tokenizer has a template; `always`: plain strings become one user turn)."""

    def __init__(self, tokenizer, chat_template: str = "auto"):
        self.tok = tokenizer
        self.mode = chat_template
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "always" and not self.has_template:
            raise ConfigError("data.chat_template=always, but the tokenizer has no chat template "
                              "(set data.chat_template=auto or never)")

    def _messages(self, prompt) -> list[dict] | None:
        if isinstance(prompt, list):
            return prompt
        if self.mode == "always":
            return [{"role": "user", "content": prompt}]
        return None

    def text(self, prompt) -> str:
        """The prompt as the model sees it (template applied)."""
        msgs = self._messages(prompt)
        if msgs is None or self.mode == "never":
            return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        if not self.has_template:
            raise ConfigError("the prompts are chat messages but the tokenizer has no chat template "
                             "(set data.chat_template=never to join the message contents)")
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def encode(self, prompt) -> list[int]:
        msgs = self._messages(prompt)
        if msgs is not None and self.mode != "never":
            return self.tok(self.text(prompt), add_special_tokens=False)["input_ids"]
        return self.tok(self.text(prompt))["input_ids"]


def max_positions(model) -> int | None:
    """The longest sequence the model's position embeddings cover, or None when it states none."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompts(encoder: PromptEncoder, rows: list[dict], what: str, *, max_new_tokens: int,
                  positions: int | None) -> None:
    """Every prompt must encode (a chat prompt needs a template), to at least one token, and leave
    room for `max_new_tokens` within the model's `positions`: ConfigError naming the row otherwise.
    Generating past the last position would fail, or (rotary models) go on silently off the range
    the model was trained on."""
    longest, where = 0, 0
    for i, row in enumerate(rows):
        n = len(encoder.encode(row["prompt"]))
        if n == 0:
            raise ConfigError(f"{what} row {i + 1}: the prompt is empty (no tokens)")
        if n > longest:
            longest, where = n, i
    if positions is not None and longest + max_new_tokens > positions:
        room = positions - longest
        fix = (f"lower rollout.max_new_tokens to {room} or drop the longest prompts" if room > 0
               else "drop or shorten the prompts that long")
        raise ConfigError(f"{what} row {where + 1}: a prompt of {longest} tokens plus rollout.max_new_tokens "
                          f"{max_new_tokens} exceeds the model's {positions} positions; {fix}")
