"""One-step-off-policy rollout (`rollout.async: true`): the engine generates batch k+1 with the
weights of step k while the trainer updates on batch k.

The schedule, for an engine that generates in the background (`submit`, grpokit.rollout.client):
  step 0:  generate batch 0 (weights 0) and wait; submit batch 1 (weights 0); update -> weights 1
  step k:  take batch k (generated with weights k-1: staleness 1); submit batch k+1 (weights k);
           update on batch k -> weights k+1, pushed once the engine has finished batch k+1.
So a batch is at most one step stale and the first is not stale at all. The trainer recomputes
pi_old with its current weights and corrects for the gap with the truncated importance weights
min(pi_old / pi_sampler, C) (`rollout.is_correction`, docs/rollout.md), as for any engine that
holds its own weights. Each batch keeps the prompts it was generated for, so rewards and
advantages always belong to the right batch.

The request in flight at a checkpoint (its prompts and seed) is part of the trainer's state: a
resumed run generates those same prompts again, with the checkpoint's weights (staleness 0).

Under data parallelism every rank keeps its own request in flight: the step's global prompt draw
(the same on every rank) is kept, each rank sends its share, and each group samples from its own
stream seeded by (seed, step, group position), as on-policy data-parallel steps do; so the state
is the global draw, whichever rank saves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpokit.errors import ConfigError
from grpokit.rollout.base import PromptStreams, RolloutBatch, SamplingParams
from grpokit.rollout.client import InThread


@dataclass
class _InFlight:
    idx: list[int]          # dataset indices of the prompts
    seed: int               # seeds the engine's sampler for this request
    handle: Any             # the engine's pending generation (`.result()`)


class OneStepOffPolicy:
    """Keeps one generation in flight. `draw()` gives the next prompts' dataset indices,
    `encode(idx)` their token ids; seeds come from `generator` (the trainer's, checkpointed)."""

    def __init__(self, engine, draw: Callable[[], list[int]], encode: Callable[[list[int]], list[list[int]]],
                 params: SamplingParams, generator: torch.Generator, *,
                 share: Callable[[list[int]], list[int]] | None = None,
                 streams: Callable[[int], PromptStreams | None] | None = None,
                 play: Callable[[list[int], Any], RolloutBatch] | None = None):
        """`draw()`: the next step's prompts (the global draw); `share(idx)`: this rank's part of it
        (default: all); `streams(step)`: the per-group streams of `step`'s first round, or None to
        seed the request from `generator`; `play(idx, generator)`: multi-turn episodes of rows `idx`,
        run on a thread of their own (each turn a request to the engine) instead of one request."""
        if not callable(getattr(engine, "submit", None)):
            raise ConfigError(f"rollout.async needs an engine that generates in the background (rollout.engine: "
                              f"server); {type(engine).__name__} does not")
        self.engine, self.draw, self.encode, self.params, self.gen = engine, draw, encode, params, generator
        self.share, self.play = share or (lambda idx: idx), play
        self.streams = streams or (lambda step: None)
        self.in_flight: _InFlight | None = None
        self.restored: dict | None = None       # a checkpoint's request, submitted again by `take`

    def submit(self, step: int, idx: list[int] | None = None, seed: int | None = None) -> None:
        """Start generating `step`'s first batch for `idx` (default: the next prompts drawn)."""
        idx = self.draw() if idx is None else list(idx)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.gen, device=self.gen.device))
        gen = self.streams(step) or torch.Generator(device=self.gen.device).manual_seed(seed)
        mine = self.share(idx)
        handle = (InThread(self.play, mine, gen, name="episodes-in-flight") if self.play is not None
                  else self.engine.submit(self.encode(mine), self.params, gen))
        self.in_flight = _InFlight(idx, seed, handle)

    def wait(self) -> None:
        """Block until the generation in flight has finished (its result stays to be taken; an
        error it raised is raised by `take`)."""
        job = self.in_flight
        if job is not None and hasattr(job.handle, "join"):
            job.handle.join()

    def take(self, step: int) -> tuple[list[int], RolloutBatch]:
        """`step`'s batch in flight (submitted now when there is none: the first step, or after a
        resume) with this rank's prompts' dataset indices."""
        if self.in_flight is None:
            self.submit(step, **(self.restored or {}))
            self.restored = None
        job, self.in_flight = self.in_flight, None
        return self.share(job.idx), job.handle.result()

    def state_dict(self) -> dict | None:
        job = self.in_flight
        return {"idx": job.idx, "seed": job.seed} if job is not None else self.restored

    def load_state_dict(self, state: dict | None) -> None:
        self.in_flight, self.restored = None, state
