"""Model judges, as rewards and as held-out checkers: `reward_model` (a local sequence-
classification model's score) and `llm_judge` (a local causal LM asked with a rubric, its score
parsed from what it answers).

Both load their model once per process (by path, device and dtype), run it frozen and batched in
inference mode, and are registered rewards like any other: list them in `rewards:` with a weight,
or name one as the held-out checker (`eval.checker: llm_judge` with `eval.checker_args`), where a
judge that shares nothing with the rule-based training reward is the independent cross-check of
the reward-hacking alarm (docs/rewards.md, "Judges"). A judge costs its model's memory and a
forward pass per completion (`llm_judge`: a short greedy generation); `time/reward_<name>` in
the step's metrics is its time. Nothing is downloaded: `model` is a local directory.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

from .registry import register

_MODELS: dict[tuple, tuple] = {}
_LOAD_LOCK = threading.Lock()


def _dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"judge dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _load(kind: str, path: str, device: str, dtype: str):
    """(model, tokenizer) for a judge, loaded once per process and frozen."""
    key = (kind, str(Path(path).resolve()), device, dtype)
    with _LOAD_LOCK:
        if key in _MODELS:
            return _MODELS[key]
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"judge model {path!r}: not a local model directory (no config.json); judges are "
                             "loaded from disk, never downloaded")
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        cls = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
        model = cls.from_pretrained(path, torch_dtype=_dtype(dtype)).to(device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = tok.pad_token_id
        _MODELS[key] = (model, tok)
        return _MODELS[key]


def judge_bytes(path: str, dtype: str = "float32") -> int:
    """Memory a judge's weights take in `dtype` (its parameter count read from the safetensors
    headers; 0 when the directory holds none): for the memory planner."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                n += math.prod(st.get_slice(k).get_shape())
    return n * (4 if dtype == "float32" else 2)


JUDGES = ("reward_model", "llm_judge")


def judge_bytes_of(cfg, device: str) -> float:
    """Bytes of the judge models a run loads on `device` (its rewards and its held-out checker; a
    judge used twice is loaded once)."""
    specs = [(r.name, r.args) for r in cfg.rewards] + [(cfg.eval.checker, cfg.eval.checker_args)]
    seen, total = set(), 0.0
    for name, args in specs:
        if name not in JUDGES or not args.get("model"):
            continue
        jdev = "cuda" if str(args.get("device", "cpu")).startswith("cuda") else "cpu"
        key = (args["model"], args.get("dtype", "float32"), jdev)
        if jdev == device and key not in seen:
            seen.add(key)
            total += judge_bytes(args["model"], args.get("dtype", "float32"))
    return total


def _check_judge_args(name: str, args: dict) -> None:
    """At config time: a judge names a local model directory."""
    path = args.get("model")
    if not path:
        raise ValueError(f"reward {name!r} needs args.model, the directory of a local model")
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"reward {name!r}: model {path!r} is not a local model directory (no config.json); "
                         "judges are loaded from disk, never downloaded")
    _dtype(args.get("dtype", "float32"))


def _group_normalise(values: list[float], groups: list) -> list[float]:
    """(v - mean) / std within each group (0 for a group of equal scores): what the advantage will
    do anyway, for a reward weighted beside 0/1 verifiers whose scale it would otherwise swamp."""
    out = list(values)
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        vals = [values[i] for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1))
        for i in idx:
            out[i] = 0.0 if std < 1e-12 else (values[i] - mean) / std
    return out


@register("reward_model", columns=[])
def reward_model(prompts, completions, *, model: str, template: str = "{prompt}{completion}",
                 device: str = "cpu", dtype: str = "float32", batch_size: int = 16, max_length: int = 2048,
                 label: int = -1, squash: str = "none", normalize: str = "none", **columns):
    """The score of a local sequence-classification model (a reward model) on `template` filled
    with the prompt, the completion and any dataset column: the logit of `label` (the last, i.e.
    the only one of a one-logit head), `squash: sigmoid` maps it to 0..1, `normalize: group`
    standardises it within each group of G (by the trainer's `group_id`)."""
    import torch

    if squash not in ("none", "sigmoid") or normalize not in ("none", "group"):
        raise ValueError(f"reward_model: squash must be none|sigmoid and normalize none|group, got {squash!r}, "
                         f"{normalize!r}")
    rm, tok = _load("classifier", model, device, dtype)
    n = len(completions)
    texts = [template.format(prompt=p, completion=c, **{k: v[i] for k, v in columns.items()})
             for i, (p, c) in enumerate(zip(prompts, completions))]
    scores: list[float] = []
    with torch.inference_mode():
        for s in range(0, n, batch_size):
            enc = tok(texts[s:s + batch_size], return_tensors="pt", padding=True, truncation=True,
                      max_length=max_length).to(device)
            logits = rm(**enc).logits.float()
            v = logits[:, label]
            scores += (torch.sigmoid(v) if squash == "sigmoid" else v).tolist()
    if normalize == "group":
        groups = columns.get("group_id")
        if groups is None:
            raise ValueError("reward_model normalize=group needs the group_id column (passed in training and evaluation)")
        scores = _group_normalise(scores, groups)
    return scores


reward_model.validate_args = _check_judge_args
reward_model.settings = ("model", "template", "device", "dtype", "batch_size", "max_length", "label", "squash",
                         "normalize")

DEFAULT_RUBRIC = ("Rate the response to the task below from 0 (wrong or useless) to 10 (correct and "
                  "complete). Answer with the number only.\n\nTask: {prompt}\n\nResponse: {completion}\n\nScore:")

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CACHE: OrderedDict[str, float | None] = OrderedDict()
_CACHE_LOCK = threading.Lock()
STATS = {"calls": 0, "cache_hits": 0, "unparsed": 0}
"""`llm_judge` counters of this process: completions judged, answered from the cache, and whose
answer held no number (scored None)."""


def parse_score(text: str, scale: float) -> float | None:
    """The first number in the judge's answer, divided by `scale` and clipped to [0, 1]; None when
    there is none."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    return min(max(float(m.group()) / scale, 0.0), 1.0)


@register("llm_judge", columns=[])
def llm_judge(prompts, completions, *, model: str, rubric: str = DEFAULT_RUBRIC, scale: float = 10.0,
              device: str = "cpu", dtype: str = "float32", batch_size: int = 16, answer_tokens: int = 8,
              max_prompt_tokens: int = 2048, chat: bool = True, cache_size: int = 10000, **columns):
    """A local causal LM judges each completion: `rubric` filled with the prompt, the completion
    and any dataset column (e.g. {answer}), decoded greedily (deterministic), its first number /
    `scale` in [0, 1]; None when it answers no number. `chat`: wrap the rubric in the judge's chat
    template when it has one. Judgements are cached by (model, rubric, prompt, completion, columns
    used) for the process (`cache_size` entries, least recently used dropped): a repeated
    completion, common once a policy converges, is not judged twice."""
    import torch

    lm, tok = _load("lm", model, device, dtype)
    used = sorted(k for k in columns if "{" + k + "}" in rubric)
    out: list[float | None] = [None] * len(completions)
    todo: list[tuple[int, str, str]] = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        fields = {k: columns[k][i] for k in used}
        text = rubric.format(prompt=p, completion=c, **fields)
        key = hashlib.sha256("\x00".join([str(Path(model).resolve()), rubric, p, c, repr(sorted(fields.items()))])
                             .encode()).hexdigest()
        with _CACHE_LOCK:
            STATS["calls"] += 1
            if key in _CACHE:
                _CACHE.move_to_end(key)
                out[i] = _CACHE[key]
                STATS["cache_hits"] += 1
                continue
        todo.append((i, key, text))
    if chat and getattr(tok, "chat_template", None):
        render = lambda t: tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,  # noqa: E731
                                                   add_generation_prompt=True)
    else:
        render = lambda t: t  # noqa: E731
    tok.padding_side = "left"
    with torch.inference_mode():
        for s in range(0, len(todo), batch_size):
            part = todo[s:s + batch_size]
            enc = tok([render(t) for _, _, t in part], return_tensors="pt", padding=True, truncation=True,
                      max_length=max_prompt_tokens, add_special_tokens=not chat).to(device)
            gen = lm.generate(**enc, do_sample=False, max_new_tokens=answer_tokens, pad_token_id=tok.pad_token_id)
            answers = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for (i, key, _), ans in zip(part, answers):
                v = parse_score(ans, scale)
                out[i] = v
                with _CACHE_LOCK:
                    STATS["unparsed"] += v is None
                    _CACHE[key] = v
                    while len(_CACHE) > cache_size:
                        _CACHE.popitem(last=False)
    return out


llm_judge.validate_args = _check_judge_args
llm_judge.settings = ("model", "rubric", "scale", "device", "dtype", "batch_size", "answer_tokens",
                      "max_prompt_tokens", "chat", "cache_size")
"""The judges' settings come from their args (or defaults), never from a dataset column of the same
name, nor from the trainer's `max_new_tokens` column (RewardSet drops those columns for them)."""
