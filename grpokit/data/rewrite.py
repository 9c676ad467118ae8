"""Wrong-answer rewriting (practitioner's rule "Dr. GRPO as practised", docs/training.md): a wrong
completion becomes a teaching sequence that says why it is wrong.

The sequence is the prompt, the wrong completion (context only), then a note built from the
verifier's own diagnosis of that completion (the first reward's `diagnose`, see
grpokit.rewards.registry: for math the value given against the expected one, for code the failing
test and its error), then the reference answer when the row has one:

    <prompt><wrong completion><template.format(why=...)><answer_template.format(answer=...)><EOS>

e.g. "That is wrong: its final answer is 45, not 46. The answer is 46." A reward without a
diagnosis gives the generic `FALLBACK_WHY`. Only the note's tokens carry loss. The auxiliary term
added to the policy loss is

    L_rewrite = weight * ( - sum_{t in note} log pi_theta(y_t | prompt, wrong, y_<t) / #note tokens )

averaged over the rewritten sequences of the step (token mean). It is a supervised likelihood term
on verifier-derived text, not a policy-gradient term: no ratio, no clipping.
"""

from __future__ import annotations

DEFAULT_TEMPLATE = "\nThat is wrong: {why}."
DEFAULT_ANSWER_TEMPLATE = " The answer is {answer}."
FALLBACK_WHY = "the verified answer differs"


def note_text(template: str, answer_template: str, *, why: str | None, answer) -> str | None:
    """The note for one wrong completion, or None when it cannot be written (the template needs an
    answer the row does not have, and there is no diagnosis to say instead)."""
    why = why.strip().rstrip(".") if why else None
    if answer is None and ("{answer}" in template or why is None):
        return None
    text = template.format(why=why or FALLBACK_WHY, answer=answer)
    if answer is not None and "{answer}" not in template:
        text += answer_template.format(answer=answer)
    return text


def rewrite_sequences(tokenizer, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      answers: list, wrong: list[bool], *, template: str = DEFAULT_TEMPLATE,
                      answer_template: str = DEFAULT_ANSWER_TEMPLATE, why: list[str | None] | None = None,
                      limit: int = 16, used: list[int] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Return (contexts, targets): context = prompt + wrong completion (EOS removed), target = note
    tokens + EOS, for up to `limit` wrong samples that have a note (`note_text`). `why`: each
    sample's diagnosis (None: the generic text); `used`, when given, receives the indices rewritten."""
    contexts, targets = [], []
    eos = tokenizer.eos_token_id
    why = why if why is not None else [None] * len(wrong)
    for k, (p, c, ans, bad, w) in enumerate(zip(prompt_ids, completion_ids, answers, wrong, why)):
        if not bad or len(contexts) >= limit:
            continue
        text = note_text(template, answer_template, why=w, answer=ans)
        if text is None:
            continue
        body = [t for t in c if t != eos and t != tokenizer.pad_token_id]
        note = tokenizer(text, add_special_tokens=False)["input_ids"]
        contexts.append(list(p) + body)
        targets.append(note + [eos])
        if used is not None:
            used.append(k)
    return contexts, targets
