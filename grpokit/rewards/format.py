"""Format rewards that pay for structure only when the content is real.

    think_answer_format = 1.0 if  <think> T </think> <answer> A </answer>  is the whole completion,
                          each tag exactly once, T and A real, else 0.0
    boxed_format        = 1.0 if exactly one complete \\boxed{B} with B real, else 0.0
    code_format         = 1.0 if the last fenced Python block parses and does something, else 0.0

"Real" content has at least one letter or digit once markup tags are removed. So the tag-hacking
outputs that a tags-only format reward teaches (practitioner's rule "rewards", docs/training.md) —
`<think></think><answer></answer>`, whitespace-only or `...` inside the tags, tags with no text, or
the tags repeated to be matched somewhere — are all worth 0. Known hole:
a format reward cannot tell real reasoning from filler words; keep its weight small next to a
correctness reward (docs/rewards.md).
"""

from __future__ import annotations

import ast
import re

from ._mathcore import boxed_contents
from .code import extract_code
from .registry import register

_TAG = re.compile(r"<[^<>]{0,64}>")


def is_real(text: str) -> bool:
    """At least one letter or digit outside markup tags."""
    return any(ch.isalnum() for ch in _TAG.sub("", text))


def check_think_answer(text: str, *, think_tag: str = "think", answer_tag: str = "answer",
                       think_in_prompt: bool = False) -> tuple[bool, str]:
    """(ok, reason). `think_in_prompt`: the chat template already opened <think>, so the
    completion starts inside it and must not open it again."""
    t_open, t_close, a_open, a_close = (f"<{think_tag}>", f"</{think_tag}>", f"<{answer_tag}>", f"</{answer_tag}>")
    want = {t_open: 0 if think_in_prompt else 1, t_close: 1, a_open: 1, a_close: 1}
    for tag, n in want.items():
        got = text.count(tag)
        if got != n:
            return False, f"{tag} appears {got} times (want {n})"
    lead = r"(?P<t>.*?)" if think_in_prompt else r"\s*" + re.escape(t_open) + r"(?P<t>.*?)"
    pat = lead + re.escape(t_close) + r"\s*" + re.escape(a_open) + r"(?P<a>.*?)" + re.escape(a_close) + r"\s*"
    m = re.fullmatch(pat, text, re.S)
    if not m:
        return False, "tags out of order or text outside them"
    if not is_real(m.group("t")):
        return False, "empty reasoning"
    if not is_real(m.group("a")):
        return False, "empty answer"
    return True, ""


def check_boxed(text: str) -> tuple[bool, str]:
    boxes = boxed_contents(text)
    opened = len(re.findall(r"\\(?:boxed|fbox)(?![A-Za-z])", text))
    if opened != 1 or len(boxes) != 1:
        return False, f"{opened} boxes opened, {len(boxes)} complete (want exactly 1)"
    if not is_real(boxes[0]):
        return False, "empty box"
    return True, ""


def check_code(text: str) -> tuple[bool, str]:
    code = extract_code(text)
    if code is None:
        return False, "no fenced python block"
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError) as e:
        return False, f"does not parse: {e.__class__.__name__}"
    trivial = (ast.Pass, ast.Import, ast.ImportFrom)
    real = [s for s in tree.body if not isinstance(s, trivial)
            and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (True, "") if real else (False, "the block does nothing")


CHECKS = {"think_answer": check_think_answer, "boxed": check_boxed, "code": check_code}


@register("think_answer_format")
def think_answer_format(prompts, completions, *, think_tag: str = "think", answer_tag: str = "answer",
                        think_in_prompt: bool = False, **columns) -> list[float]:
    """1.0 for exactly one non-empty <think> block followed by one non-empty <answer> block."""
    return [float(check_think_answer(c, think_tag=think_tag, answer_tag=answer_tag,
                                     think_in_prompt=think_in_prompt)[0]) for c in completions]


@register("boxed_format")
def boxed_format(prompts, completions, **columns) -> list[float]:
    """1.0 for exactly one complete, non-empty \\boxed{...}."""
    return [float(check_boxed(c)[0]) for c in completions]


@register("code_format")
def code_format(prompts, completions, **columns) -> list[float]:
    """1.0 if the last fenced Python block parses and has a statement beyond pass/imports/docstrings."""
    return [float(check_code(c)[0]) for c in completions]
