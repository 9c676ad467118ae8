"""Prompt datasets (JSONL, Parquet, or a `datasets` dataset saved on disk) and a resumable sampler.

A row is a dict with a prompt (string or list of chat messages) and, usually, a reference answer.
Every other column travels with the prompt to the reward functions. Bad input never passes
silently: a malformed row is an error naming the file and line, an empty dataset is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """A one-line, user-facing dataset error."""


@dataclass
class PromptDataset:
    rows: list[dict]
    source: str = ""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _check_row(row, where: str, prompt_field: str, answer_field: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if prompt_field not in row:
        raise DataError(f"{where}: missing field '{prompt_field}' (fields: {', '.join(sorted(row)) or 'none'})")
    prompt = row[prompt_field]
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)
    )
    if not ok:
        raise DataError(f"{where}: field '{prompt_field}' must be a string or a list of chat messages")
    out = dict(row)
    out["prompt"] = out.pop(prompt_field)
    if answer_field != "answer" and answer_field in out:
        out["answer"] = out.pop(answer_field)
    if "answer" in out and out["answer"] is not None and not isinstance(out["answer"], str):
        out["answer"] = str(out["answer"])
    return out


def load_prompts(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer") -> PromptDataset:
    """Load prompts from `path`; rows are normalised to carry `prompt` and `answer` keys."""
    p = Path(path)
    if not str(path):
        raise DataError("no dataset path given (set data.path)")
    if not p.exists():
        raise DataError(f"dataset not found: {p}")
    if p.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError:
            raise DataError(f"{p} is a directory: reading a saved `datasets` dataset needs `pip install datasets`") from None
        ds = load_from_disk(str(p))
        if hasattr(ds, "keys") and not hasattr(ds, "column_names"):  # a DatasetDict
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        raw = [(f"{p} row {i + 1}", r) for i, r in enumerate(ds)]
    elif p.suffix == ".jsonl":
        raw = []
        with p.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    raw.append((f"{p}:{n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{p}:{n}: malformed JSON ({exc.msg})") from None
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file
            raise DataError(f"{p}: cannot read Parquet ({exc})") from None
        raw = [(f"{p} row {i + 1}", r) for i, r in enumerate(table.to_pylist())]
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{exc.lineno}: malformed JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json dataset must be a list of objects")
        raw = [(f"{p} item {i + 1}", r) for i, r in enumerate(data)]
    else:
        raise DataError(f"{p}: unsupported dataset format (use .jsonl, .json, .parquet or a saved datasets dir)")
    return _checked(raw, str(p), prompt_field, answer_field)


def prompts_from_rows(rows, *, source: str = "dataset", prompt_field: str = "prompt",
                      answer_field: str = "answer") -> PromptDataset:
    """Prompts from rows already in memory (dicts, e.g. a list or a `datasets.Dataset`), checked and
    normalised like a file's rows; errors name the row as `<source> row N`."""
    return _checked([(f"{source} row {i + 1}", r) for i, r in enumerate(rows)], source, prompt_field, answer_field)


def _checked(raw: list[tuple[str, object]], source: str, prompt_field: str, answer_field: str) -> PromptDataset:
    rows = [_check_row(r, where, prompt_field, answer_field) for where, r in raw]
    if not rows:
        raise DataError(f"{source}: the dataset is empty")
    return PromptDataset(rows, source)


HELDOUT_MIN = 20
"""Fewest prompts a carved held-out split holds: below it greedy pass@1 moves in steps of more than
5 points, too coarse for the reward-hacking trend test."""


def _prompt_key(row: dict) -> str:
    p = row["prompt"]
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True, ensure_ascii=False)


def carve_heldout(dataset: PromptDataset, fraction: float, cap: int, seed: int
                  ) -> tuple[PromptDataset, PromptDataset] | str:
    """(training, held-out): `fraction` of the distinct prompts (at least HELDOUT_MIN, at most `cap`)
    drawn with `seed`, each held out once and every row of it removed from training (a prompt
    repeated in the data never sits on both sides). When the data is too small to give that many
    and keep four times as many for training, the reason as a string instead."""
    keys: dict[str, list[int]] = {}
    for i, row in enumerate(dataset.rows):
        keys.setdefault(_prompt_key(row), []).append(i)
    distinct = list(keys)
    want = min(max(round(fraction * len(distinct)), HELDOUT_MIN), cap)
    if want < HELDOUT_MIN or len(distinct) - want < 4 * want:
        return (f"{len(distinct)} distinct prompts are too few to hold {max(want, HELDOUT_MIN)} out for "
                f"evaluation and train on four times as many")
    chosen = np.random.default_rng([seed, 0x5E1D]).choice(len(distinct), size=want, replace=False)
    out = {i for k in chosen for i in keys[distinct[k]]}
    held = sorted(keys[distinct[k]][0] for k in chosen)             # each held-out prompt once
    src = dataset.source or "dataset"
    return (PromptDataset([r for i, r in enumerate(dataset.rows) if i not in out], src),
            PromptDataset([dataset.rows[i] for i in held], f"{src} (held-out split)"))


@dataclass
class PromptSampler:
    """Endless, seeded, resumable order over a dataset: reshuffled every epoch.

    `state_dict()` captures the epoch and position, so a resumed run draws the same prompts.
    """

    size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    pos: int = 0
    _order: np.ndarray = field(default=None, repr=False)

    def __post_init__(self):
        if self.size <= 0:
            raise DataError("cannot sample from an empty dataset")
        self._order = self._make_order(self.epoch)

    def _make_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.pos >= self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order(self.epoch)
            take = min(n - len(out), self.size - self.pos)
            out += self._order[self.pos:self.pos + take].tolist()
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise DataError(f"resume: the dataset has {self.size} prompts, the checkpoint saw {state['size']}")
        self.epoch, self.pos, self.seed = state["epoch"], state["pos"], state["seed"]
        self._order = self._make_order(self.epoch)
