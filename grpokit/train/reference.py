"""The frozen reference policy pi_ref of the KL penalty, as one object with one `logprobs()` method.

Two kinds, chosen by `grpokit.train.build`:
- a frozen copy of the policy at the start of training (`Reference.frozen_copy`), placed by
  `algorithm.kl.ref_device`: on the policy's device, on the CPU (run there), or on the CPU and
  moved to the policy's device for each reference pass and back (`swap`);
- a LoRA policy with its adapters disabled (`Reference.adapters_off`): the base weights are the
  reference, with no second copy of them.

Reference dropout (`algorithm.kl.ref_dropout`, docs/variants.md) applies dropout to the
reference's hidden states while computing the KL term. The cache (`algorithm.kl.ref_cache`): a
reference that never changes gives the same log-probs for the same (prompt, completion) token
ids, so repeated samples (identical completions in a group, prompts seen again in a later epoch)
are looked up instead of recomputed; a cached row can differ from a fresh computation by float
rounding only (padding changes the summation order).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import OrderedDict
from typing import Callable, Hashable

import torch

from grpokit.train.batch import select
from grpokit.train.dropout import hidden_dropout
from grpokit.train.guard import ReferenceDriftError
from grpokit.train.logprobs import MicroBatch, padded_logprobs


def frozen_copy(model):
    """A frozen snapshot of `model` (eval mode, no gradients)."""
    ref = copy.deepcopy(model)
    ref.eval()
    for prm in ref.parameters():
        prm.requires_grad_(False)
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


AUTO_CACHE_SIZE = 4096       # `ref_cache: auto`: entries held
AUTO_TRIAL_CALLS = 10        # reference passes before `auto` judges the cache
AUTO_MIN_HIT_RATE = 0.05     # hit rate under which `auto` lets the cache go


class RefLogprobCache:
    """LRU cache of reference log-prob vectors keyed by (prompt ids, completion ids)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.store: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.hits = self.lookups = self.calls = 0          # cumulative
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
        self.calls += 1
        self.last_lookups, self.last_hits = len(keys), len(keys) - len(todo)
        self.lookups += self.last_lookups
        self.hits += self.last_hits
        return out

    def metrics(self) -> dict[str, float]:
        return {"ref/cache_hit_rate": self.last_hits / max(self.last_lookups, 1),
                "ref/cache_hit_rate_total": self.hits / max(self.lookups, 1),
                "ref/cache_entries": float(len(self.store))}


log = logging.getLogger("grpokit.train")

Planner = Callable[[list[int]], list[MicroBatch]]   # rows of a batch -> micro-batches over them


class Reference:
    """pi_ref. `logprobs(batch, plan)` gives its per-token log-probs of a batch's completions."""

    def __init__(self, module, *, adapters_off: bool = False, device: torch.device | str | None = None,
                 swap: bool = False, dropout: float = 0.0, cache_size: int | str = 0,
                 temperature: float = 1.0, chunk_tokens: int = 1024):
        if adapters_off and not hasattr(module, "disable_adapter"):
            raise ValueError("an adapters-off reference needs a PEFT model")
        self.module = module
        self.adapters_off = adapters_off
        self.device = torch.device(device) if device is not None else next(module.parameters()).device
        self.swap = swap
        self.dropout = dropout
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        # cached vectors would freeze one draw of the dropout mask: no cache with dropout
        self.cache_auto = cache_size == "auto"
        size = AUTO_CACHE_SIZE if self.cache_auto else int(cache_size)
        self.cache = RefLogprobCache(size) if size and dropout == 0 else None
        self.cache_released = False

    @classmethod
    def frozen(cls, model, *, placement: str = "same", **kw) -> "Reference":
        """A frozen copy of `model`, placed per `placement` ("same" | "cpu" | "swap")."""
        ref = frozen_copy(model)
        device = next(model.parameters()).device
        if placement in ("cpu", "swap"):
            ref.to("cpu")
        return cls(ref, device="cpu" if placement == "cpu" else device, swap=placement == "swap", **kw)

    @classmethod
    def of_adapters_off(cls, peft_model, **kw) -> "Reference":
        return cls(peft_model, adapters_off=True, **kw)

    @contextlib.contextmanager
    def _active(self, dropout: float):
        """The module that computes pi_ref, ready to run (adapters off / swapped in, dropout hooks)."""
        if self.adapters_off:
            with self.module.disable_adapter(), hidden_dropout(self.module, dropout):
                yield self.module
        else:
            with hidden_dropout(self.module, dropout), swapped_in(self.module, self.device, self.swap):
                yield self.module

    def _compute(self, plan: Planner, rows: list[int], shape, dropout: float) -> torch.Tensor:
        with self._active(dropout) as module:
            return padded_logprobs(module, plan(rows), shape, temperature=self.temperature,
                                   chunk_tokens=self.chunk_tokens)

    def logprobs(self, batch, plan: Planner, *, rows: list[int] | None = None,
                 dropout: bool = True) -> torch.Tensor:
        """[B, T] reference log-probs of `batch` (a `grpokit.train.batch.Batch`) for `rows` (all by
        default; other rows hold 0), through the cache when there is one. `plan` cuts rows into
        micro-batches. `dropout=False` turns reference dropout off (the integrity probe)."""
        rows = list(range(len(batch))) if rows is None else rows
        shape = tuple(batch.mask.shape)
        p = self.dropout if dropout else 0.0
        if self.cache is None or not dropout:
            return self._compute(plan, rows, shape, p)
        keys = {r: RefLogprobCache.key(batch.prompt_ids[r], batch.completion_ids[r, :int(batch.mask[r].sum())])
                for r in rows}

        def compute(todo: list[int]) -> dict[int, torch.Tensor]:
            full = self._compute(plan, todo, shape, p)
            return {r: full[r, :int(batch.mask[r].sum())].clone() for r in todo}

        per_row = self.cache.fetch(keys, compute)
        out = torch.zeros(shape, dtype=next(iter(per_row.values())).dtype if per_row else torch.float32)
        for r, v in per_row.items():
            out[r, :len(v)] = v
        self._judge_auto_cache()
        return out

    def _judge_auto_cache(self) -> None:
        """`ref_cache: auto`: after its trial, a cache that rarely hits is let go (said once)."""
        c = self.cache
        if not self.cache_auto or c is None or c.calls < AUTO_TRIAL_CALLS:
            return
        rate = c.hits / max(c.lookups, 1)
        if rate < AUTO_MIN_HIT_RATE:
            log.info("reference log-prob cache let go: %.1f%% of %d samples repeated in its first %d passes "
                     "(algorithm.kl.ref_cache: auto; a number keeps it)", 100 * rate, c.lookups, c.calls)
            self.cache, self.cache_released = None, True
        self.cache_auto = False                                  # judged once

    def metrics(self) -> dict[str, float]:
        if self.cache is None:
            return {"ref/cache_entries": 0.0} if self.cache_released else {}
        return self.cache.metrics()


class ReferenceProbe:
    """Reference integrity: the reference's log-probs on a fixed probe batch (the first rows of the
    first batch seen) are recorded once and recomputed every `guard.ref_check_every` steps. A
    change beyond `guard.ref_tolerance` is logged (the `ref_drift` alarm reads
    `ref/integrity_drift`) or, with `guard.ref_strict`, raised."""

    def __init__(self, guard_cfg, rows: int = 8):
        self.cfg, self.rows = guard_cfg, rows
        self.probe = None                    # (Batch, [b, T] log-probs)

    def check(self, worker, batch, step: int) -> float | None:
        """The largest absolute change in nats (NaN when they stopped being finite), 0.0 when the
        probe was just recorded, None when nothing was checked this step (`step`: steps done)."""
        if self.probe is None:
            probe = select(batch, list(range(min(self.rows, len(batch)))))
            self.probe = (probe, worker.logprobs(probe, "reference", dropout=False).float())
            return 0.0
        if (step + 1) % self.cfg.ref_check_every:
            return None
        probe, base = self.probe
        now = worker.logprobs(probe, "reference", dropout=False).float()
        diffs = (now - base).abs()[probe.mask.bool()]
        drift = float(diffs.max()) if diffs.numel() else 0.0                   # max propagates NaN
        if not drift <= self.cfg.ref_tolerance:
            msg = f"reference log-probs drifted by {drift:.3g} nats on the probe batch (tolerance {self.cfg.ref_tolerance:g})"
            if self.cfg.ref_strict:
                raise ReferenceDriftError(msg + ": the reference model changed (guard.ref_strict)")
            log.warning(msg)
        return drift

    def state_dict(self):
        return self.probe

    def load_state_dict(self, probe) -> None:
        self.probe = probe
