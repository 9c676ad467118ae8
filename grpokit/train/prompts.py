"""Turning dataset prompts (plain strings or chat messages) into token ids."""

from __future__ import annotations


class PromptEncoder:
    """Encodes a prompt, applying the tokenizer's chat template where asked (`auto`: for chat
    messages when the tokenizer has a template; `always`: plain strings become one user turn)."""

    def __init__(self, tokenizer, chat_template: str = "auto"):
        self.tok = tokenizer
        self.mode = chat_template
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template == "always" and not self.has_template:
            raise ValueError("data.chat_template=always, but the tokenizer has no chat template")

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
            raise ValueError("the prompts are chat messages but the tokenizer has no chat template "
                             "(set data.chat_template=never to join the message contents)")
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def encode(self, prompt) -> list[int]:
        msgs = self._messages(prompt)
        if msgs is not None and self.mode != "never":
            return self.tok(self.text(prompt), add_special_tokens=False)["input_ids"]
        return self.tok(self.text(prompt))["input_ids"]
