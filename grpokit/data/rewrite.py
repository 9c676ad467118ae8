"""Wrong-answer rewriting (practitioner's rule "Dr. GRPO as practised", docs/training.md): a wrong
completion becomes a teaching sequence.

The sequence is the prompt, the wrong completion (context only), then a templated note saying it
is wrong and why, then the correct answer when one is known:

    <prompt><wrong completion><note: template.format(answer=...)><EOS>

Only the note and answer tokens carry loss. The auxiliary term added to the policy loss is

    L_rewrite = weight * ( - sum_{t in note} log pi_theta(y_t | prompt, wrong, y_<t) / #note tokens )

averaged over the rewritten sequences of the step (token mean). It is a supervised likelihood term
on verifier-derived text, not a policy-gradient term: no ratio, no clipping.
"""

from __future__ import annotations

DEFAULT_TEMPLATE = "\nThat is wrong: the verified answer differs. The answer is {answer}."


def rewrite_sequences(tokenizer, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      answers: list[str | None], wrong: list[bool], *, template: str = DEFAULT_TEMPLATE,
                      limit: int = 16) -> tuple[list[list[int]], list[list[int]]]:
    """Return (contexts, targets): context = prompt + wrong completion (EOS removed), target = note
    tokens + EOS, for up to `limit` wrong samples that have a known answer."""
    contexts, targets = [], []
    eos = tokenizer.eos_token_id
    for p, c, ans, bad in zip(prompt_ids, completion_ids, answers, wrong):
        if not bad or ans is None or len(contexts) >= limit:
            continue
        body = [t for t in c if t != eos and t != tokenizer.pad_token_id]
        note = tokenizer(template.format(answer=ans), add_special_tokens=False)["input_ids"]
        contexts.append(list(p) + body)
        targets.append(note + [eos])
    return contexts, targets
