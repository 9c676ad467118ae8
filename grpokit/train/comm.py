"""The run's one answer to "which rank am I, and what do the others say?".

Every run has a `Comm`: a single process gets `LocalComm` (rank 0 of 1; its gather, reduce, any and
broadcast are identities), a rank of a torchrun job gets `grpokit.train.distributed.DistContext`
(the same methods over a torch.distributed process group). The driver, the collector and the run
directory call these methods and never ask whether the run is distributed; rank-0-only writing is
`comm.is_main`, decided here (torchtitan's `ParallelDims` plays the same part there).

What follows from rank and world alone (each rank's share of a step's prompts, group numbers, the
dynamic-sampling quota, sampling seeds) lives in the base class, so one process and N ranks run the
same code. Sampling streams are the one place where one process and a job differ on purpose: one
process draws every group from the trainer's generator (its state is checkpointed), a job draws each
group from a stream seeded by (seed, step, group position), so that a group draws the same
completions at any world size (docs/distributed.md, "Groups and normalisation").
"""

from __future__ import annotations

import hashlib

import torch


def seed_of(key: str) -> int:
    """A 63-bit seed from a string key (stable across processes and Python versions)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


class Comm:
    """Collectives and the arithmetic of whole groups per rank. Subclasses set `rank`, `world` and
    `device` (the device collectives run on) and provide the five collectives; the rest is derived."""

    per_group_streams = False
    """True: each group samples from its own seeded stream (`group_streams`); False: from the run's
    generator, whose state the checkpoint keeps."""

    @property
    def is_main(self) -> bool:
        """The rank that writes the run directory, prints and reports."""
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    def all_sum(self, values: list[float]) -> list[float]:
        raise NotImplementedError

    def all_max(self, value: float) -> float:
        raise NotImplementedError

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order (small Python objects: counts, metric dicts)."""
        raise NotImplementedError

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Leave the job (tear down what `init` started); idempotent."""

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (the guard's and early stop's decisions)."""
        return self.all_max(1.0 if flag else 0.0) > 0

    # ------------------------------------------------------------------ data
    def my_prompts(self, indices: list[int]) -> list[int]:
        """This rank's share of a step's global prompt list: every world-th prompt from its rank."""
        return indices[self.rank::self.world]

    def first_group(self, first: int, prompts: int) -> int:
        """The number of this rank's first group in a sampling round of `prompts` prompts whose first
        is the step's `first`-th (group numbers unique in the step). A round need not divide evenly
        over the ranks: the lower ranks then hold one group more (`my_prompts`)."""
        return first + sum(len(range(q, prompts, self.world)) for q in range(self.rank))

    def keep_groups(self, n_local: int, wanted: int) -> tuple[int, int, int]:
        """Dynamic sampling over ranks: each rank found `n_local` groups worth keeping; at most
        `wanted` more are needed globally. Returns (groups this rank keeps, groups kept over all
        ranks, groups found over all ranks): the quota is filled in rank order, so the ranks agree
        without a coordinator."""
        counts = self.gather(int(n_local))
        before = sum(counts[:self.rank])
        mine = max(0, min(n_local, wanted - before))
        return mine, min(sum(counts), wanted), sum(counts)

    def step_seed(self, seed: int, step: int) -> int:
        """The sampling seed of this rank at `step`: derived from (seed, step, rank), so a resumed
        run at the same world size draws exactly what the uninterrupted one drew."""
        return seed_of(f"{seed}:{step}:{self.rank}")

    def group_seeds(self, seed: int, step: int, first: int, prompts: int) -> list[int]:
        """Sampling seeds of this rank's groups among `prompts` drawn at global position `first` of
        `step`: each derived from (seed, step, the group's global position) alone, so a group draws
        the same completions at any world size (exact resume 2 -> 1 -> 2)."""
        return [seed_of(f"{seed}:{step}:g{first + q}") for q in self.my_prompts(list(range(prompts)))]

    def seed_step(self, gen: torch.Generator, seed: int, step: int) -> None:
        """Before a step's rollout: reseed `gen` from (seed, step, rank) where groups have streams of
        their own; one process keeps its generator running (its state is checkpointed)."""
        if self.per_group_streams:
            gen.manual_seed(self.step_seed(seed, step))

    def group_streams(self, seed: int, step: int, first: int, prompts: int) -> list[int] | None:
        """The seeds of this rank's groups in a sampling round, or None: sample from the generator."""
        return self.group_seeds(seed, step, first, prompts) if self.per_group_streams else None

    # ------------------------------------------------------------------ metrics
    def reduce_metrics(self, metrics: dict, agreed=frozenset()) -> dict:
        """Every rank's metrics combined into the job's (the same dict on every rank): sums for the
        per-rank shares of a global quantity, max / min for extremes and times, the mean of the
        ranks' values otherwise (docs/distributed.md, "Metrics"). Keys in `agreed` already hold the
        job's value on every rank and are kept as they are."""
        numeric = {k: float(v) for k, v in metrics.items() if k not in agreed
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        rest = {k: v for k, v in metrics.items() if k not in numeric}
        every = self.gather(numeric)
        out: dict = {}
        for k in dict.fromkeys(k for d in every for k in d):
            vals = [d[k] for d in every if k in d]
            how = reduction(k)
            out[k] = sum(vals) if how == "sum" else max(vals) if how == "max" else min(vals) if how == "min" \
                else sum(vals) / len(vals)
        return {**out, **rest}


class LocalComm(Comm):
    """One process: rank 0 of 1, every collective an identity."""

    mode = "none"

    def __init__(self, device: torch.device | str = "cpu"):
        self.rank, self.world, self.device = 0, 1, torch.device(device)

    def all_sum(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def all_max(self, value: float) -> float:
        return float(value)

    def gather(self, obj) -> list:
        return [obj]

    def broadcast(self, obj):
        return obj

    def barrier(self) -> None:
        pass

    def reduce_metrics(self, metrics: dict, agreed=frozenset()) -> dict:
        return metrics


SUMMED = ("loss/", "throughput/", "reward/nonfinite", "rollout/resampled", "filter/dropped", "filter/uninformative",
          "rewrite/")
"""Metrics that are each rank's share of a job-wide total: the losses (each rank's loss is
normalised by the global token or sequence count, so the shares add up to the global loss),
throughput, and counts of events."""


def reduction(key: str) -> str:
    """How `key` combines over ranks: "sum", "max", "min" or "mean"."""
    if key.startswith(SUMMED) or key.endswith("/errors"):
        return "sum"
    if key.startswith(("time/", "memory/", "sync/")) or key.endswith(("_max", "ratio_max", "/integrity_drift")):
        return "max"                   # the slowest rank sets the pace; the largest process the memory;
                                       # one rank sends a rollout server the weights (sync/)
    if key.endswith("_min"):
        return "min"
    return "mean"
