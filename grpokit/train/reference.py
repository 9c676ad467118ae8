"""The frozen reference: where its copy lives, and a cache of its per-sample log-probs.

Seed 5.4 (memory): a separate reference copy can live on the CPU while the policy is on a GPU,
either run there (`algorithm.kl.ref_device: cpu`) or moved to the policy's device for each
reference pass and back (`swap`). A LoRA run needs neither: its reference is the policy with the
adapters disabled (grpokit.train.lora).

Seed 3.4 (caching): a reference that never changes gives the same log-probs for the same
(prompt, completion) token ids, so repeated samples (identical completions in a group, prompts seen
again in a later epoch) are looked up instead of recomputed. Cached vectors come from whichever
micro-batch first computed them; they can differ from a fresh computation by float rounding only
(padding changes the summation order), never by more.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Hashable

import torch

from grpokit.train.model import frozen_copy


def build_reference(cfg, model):
    """A frozen copy of `model` placed per `algorithm.kl.ref_device`, or None when beta = 0."""
    k = cfg.algorithm.kl
    if k.beta == 0:
        return None
    ref = frozen_copy(model)
    if k.ref_device in ("cpu", "swap"):
        ref.to("cpu")
    return ref


@contextlib.contextmanager
def swapped_in(model, device: torch.device, enabled: bool = True):
    """Move `model` to `device` for the duration of the block, then back to the CPU."""
    if not enabled or next(model.parameters()).device == torch.device(device):
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to("cpu")
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


class RefLogprobCache:
    """LRU cache of reference log-prob vectors keyed by (prompt ids, completion ids)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.store: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.hits = self.lookups = 0          # cumulative
        self.last_hits = self.last_lookups = 0

    @staticmethod
    def key(prompt_ids, completion_ids) -> tuple:
        p = tuple(prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)
        c = tuple(completion_ids.tolist() if torch.is_tensor(completion_ids) else completion_ids)
        return (p, c)

    def fetch(self, keys: dict[int, Hashable], compute: Callable[[list[int]], dict[int, torch.Tensor]]
              ) -> dict[int, torch.Tensor]:
        """Log-probs for every row of `keys`. Rows whose key is cached, or repeats an earlier row's key,
        are not recomputed; `compute(rows)` is called once with one row per missing key."""
        first_row: dict[Hashable, int] = {}
        todo = []
        for r, k in keys.items():
            if k not in self.store and k not in first_row:
                first_row[k] = r
                todo.append(r)
        fresh = compute(todo) if todo else {}
        out = {}
        for r, k in keys.items():
            if k in self.store:
                self.store.move_to_end(k)
                out[r] = self.store[k]
            else:
                out[r] = fresh[first_row[k]]
        for k, r in first_row.items():
            self.store[k] = fresh[r]
        while len(self.store) > self.capacity:
            self.store.popitem(last=False)
        self.last_lookups, self.last_hits = len(keys), len(keys) - len(todo)
        self.lookups += self.last_lookups
        self.hits += self.last_hits
        return out

    def metrics(self) -> dict[str, float]:
        return {"ref/cache_hit_rate": self.last_hits / max(self.last_lookups, 1),
                "ref/cache_hit_rate_total": self.hits / max(self.lookups, 1),
                "ref/cache_entries": float(len(self.store))}
