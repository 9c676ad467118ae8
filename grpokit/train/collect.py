"""One rollout round: the prompts of a step drawn, their G completions generated and scored, and,
with dynamic sampling (DAPO, Yu et al. 2025), groups that carry no signal dropped and refilled from
fresh prompts, up to `rollout.max_sampling_rounds` rounds.

A round draws the prompts per step (`rollout.dynamic_width: fixed`) or, by default, as many as the
groups still missing need at the share of groups kept so far (`KeepRate`), so that a step is mostly
one wide generation: a decode batch costs much less per row when it is wide than when it is thin.

In a data-parallel job each rank collects its own whole groups of the step's global draw (the
`Comm` says which, and how many kept groups the job still needs); one process is rank 0 of 1 and
runs the same code. With `rollout.async` the first round's batch was generated while the previous
step trained (grpokit.train.overlap).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from grpokit.data.curriculum import Curriculum
from grpokit.data.datasets import PromptSampler
from grpokit.rollout.base import PromptStreams, RolloutBatch, SamplingParams
from grpokit.rollout.episodes.metrics import episode_columns, episode_counts, episode_metrics
from grpokit.train import batch as batch_lib
from grpokit.train.batch import Batch
from grpokit.train.comm import Comm
from grpokit.train.overlap import OneStepOffPolicy
from grpokit.train.prompts import PromptEncoder
from grpokit.train.transforms import DynamicSampling, StepContext, rewards_tensor


@dataclass
class KeepRate:
    """The share of sampled groups that dynamic sampling found worth keeping, measured over the run
    (each step's counts weigh `decay` times the next step's), and the width of a sampling round
    sized from it. Counted over the whole job, so every rank computes the same widths, and kept in
    the checkpoint, so a resumed run draws what the uninterrupted one drew."""

    found: float = 0.0
    sampled: float = 0.0
    decay: float = 0.5

    def new_step(self) -> None:
        self.found *= self.decay
        self.sampled *= self.decay

    def add(self, found: int, sampled: int) -> None:
        self.found += found
        self.sampled += sampled

    @property
    def rate(self) -> float:
        """The measured share, with one prior group kept out of one sampled (1 before any data)."""
        return (self.found + 1.0) / (self.sampled + 1.0)

    def width(self, missing: int, budget: int, confidence: float) -> int:
        """The fewest prompts, at least `missing` and at most `budget`, of which at least `missing`
        groups are kept with probability `confidence` when each is kept at the measured rate
        independently (a binomial tail; the tail grows with the width, so a bisection finds it)."""
        if missing <= 0 or budget <= 0:
            return 0
        lo, hi = min(missing, budget), budget
        if keep_probability(hi, missing, self.rate) < confidence:
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if keep_probability(mid, missing, self.rate) >= confidence:
                hi = mid
            else:
                lo = mid + 1
        return lo


def keep_probability(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): the chance that n sampled groups hold k worth keeping."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    below = sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                for i in range(k))
    return max(0.0, 1.0 - below)


def owns_weights(engine) -> bool:
    """True for an engine that samples with its own copy of the weights (pushed after each step)."""
    return bool(getattr(engine, "owns_weights", False))


class Collector:
    """Generates and scores one step's batch of `prompts_per_step` groups (this rank's share)."""

    def __init__(self, *, engine, encoder: PromptEncoder, rewards, dataset, sampler: PromptSampler, comm: Comm,
                 gen: torch.Generator, params: SamplingParams, prompts_per_step: int, seed: int,
                 max_rounds: int = 1, dynamic: DynamicSampling | None = None, curriculum: Curriculum | None = None,
                 pool_factor: int = 1, pad_id: int = 0, async_: bool = False, steps: int = 0, episodes=None,
                 width: str = "keep_rate", confidence: float = 0.9):
        """`episodes`: a grpokit.rollout.episodes.EpisodeRunner over `engine` (multi-turn rollouts).
        `width`, `confidence`: `rollout.dynamic_width` and `rollout.dynamic_confidence`."""
        self.engine, self.encoder, self.rewards, self.dataset = engine, encoder, rewards, dataset
        self.episodes = episodes
        self.sampler, self.comm, self.gen, self.params = sampler, comm, gen, params
        self.P, self.seed, self.dynamic, self.curriculum = prompts_per_step, seed, dynamic, curriculum
        self.rounds = max_rounds if dynamic is not None else 1
        self.keep_rate = KeepRate() if dynamic is not None and width == "keep_rate" else None
        self.confidence = confidence
        self.pool_factor, self.pad_id, self.steps = pool_factor, pad_id, steps
        self.overlap = (OneStepOffPolicy(engine, lambda: self.draw_prompts(self.P, self.step_idx),
                                         self.encode_prompts, params, gen, share=comm.my_prompts,
                                         streams=self._first_round_streams,
                                         play=self._play if episodes is not None else None) if async_ else None)
        self.step_idx = 0                            # the step being collected (async draws read it)
        self.scored: list[Batch] = []                # every round's scored batch this step, before dynamic
                                                     # sampling drops groups (the curriculum reads them all)

    def _first_round_streams(self, step: int) -> PromptStreams | None:
        seeds = self.comm.group_streams(self.seed, step, 0, self.P)
        return PromptStreams(seeds) if seeds is not None else None

    def encode_prompts(self, idx: list[int]) -> list[list[int]]:
        return [self.encoder.encode(self.dataset[i]["prompt"]) for i in idx]

    def sample(self, rows: list[dict], streams: PromptStreams | None = None) -> RolloutBatch:
        """Completions of `rows` from the run's generator, or one stream per prompt."""
        if self.episodes is not None:
            return self.episodes.run(rows, self.params, self.gen if streams is None else streams)
        return self.engine.generate([self.encoder.encode(row["prompt"]) for row in rows], self.params,
                                    self.gen if streams is None else streams)

    def _play(self, idx: list[int], generator) -> RolloutBatch:
        """The episodes of dataset rows `idx` (run in the background with `rollout.async`)."""
        return self.episodes.run([self.dataset[i] for i in idx], self.params, generator)

    def settle(self) -> dict[str, float]:
        """Wait for episodes in flight (`rollout.async`) before the weights are pushed: every turn of
        the next batch's episodes is then sampled by the weights the batch was submitted with, the
        weights the staleness and the importance correction account for. Single-turn requests need
        no wait here (a rollout server loads weights only between generations)."""
        if self.overlap is None or self.episodes is None:
            return {}
        t = time.perf_counter()
        self.overlap.wait()
        return {"time/rollout_wait": time.perf_counter() - t}

    def reward_inputs(self, batch: Batch) -> tuple[list[str], list[str], dict[str, list]]:
        """(prompts, completions, columns) as the rewards see them: every dataset column of the rows
        plus completion_length, finish_reason, group_id and max_new_tokens."""
        keys = sorted({k for row in batch.rows for k in row if k != "prompt"})
        columns = {k: [row.get(k) for row in batch.rows] for k in keys}
        columns.update(completion_length=batch.lengths.tolist(), finish_reason=list(batch.finish_reason),
                       group_id=batch.group_id.tolist(), max_new_tokens=[self.params.max_new_tokens] * len(batch))
        if batch.episodes is not None:
            prompts, completions = episode_columns(self.episodes, batch.prompt_ids, batch.completions,
                                                   batch.episodes, columns)
        else:
            prompts, completions = [self.encoder.text(row["prompt"]) for row in batch.rows], batch.completions
        return prompts, completions, columns

    def diagnose(self, batch: Batch, rows: list[int]) -> list[str | None]:
        """Why each of `rows` fails the first reward, in words (grpokit.rewards.registry), or None."""
        prompts, completions, columns = self.reward_inputs(batch)
        return self.rewards.diagnose([prompts[i] for i in rows], [completions[i] for i in rows],
                                     {k: [v[i] for i in rows] for k, v in columns.items()})

    def score(self, batch: Batch) -> Batch:
        """Fill the batch's rewards: weighted totals (NaN = could not be scored) and each function's."""
        prompts, completions, columns = self.reward_inputs(batch)
        out = self.rewards.score(prompts, completions, columns)
        batch.rewards = rewards_tensor(out.total)
        batch.scores = {k: list(v) for k, v in out.per_fn.items()}
        batch.reward_metrics = {k: float(v) for k, v in out.metrics.items()}
        return batch

    def segments(self, batch: Batch) -> Batch:
        """Step-wise episodes (a template that rewrites earlier turns) as one row per turn; other
        batches as they are (grpokit.train.batch.to_segments)."""
        if self.episodes is None or not self.episodes.per_turn:
            return batch
        return batch_lib.to_segments(batch, self.pad_id, decode=lambda ids: self.episodes.tok.decode(ids))

    def draw_prompts(self, n: int, step: int) -> list[int]:
        """Dataset indices for n prompts: the shuffled order, or the curriculum's pick from it."""
        if self.curriculum is None:
            return self.sampler.next(n)
        pool = self.sampler.next(n * self.pool_factor)
        return self.curriculum.choose(pool, [self.dataset[i] for i in pool], n, step)

    def collect(self, step: int) -> tuple[Batch, dict]:
        """Sample and score one batch of `prompts_per_step` groups. With dynamic sampling, groups
        whose rewards are all equal are dropped and fresh prompts sampled, up to `max_rounds`
        rounds; if none survives, the step trains on the last round's first groups (advantages 0)."""
        P, G, comm = self.P, self.params.n, self.comm
        self.step_idx = step
        kept: list[Batch] = []
        n_kept, drawn, surplus, rounds, t_roll, t_rew = 0, 0, 0, 0, 0.0, 0.0
        self.scored, timings = [], []
        if self.keep_rate is not None:
            self.keep_rate.new_step()
            rate = self.keep_rate.rate                # the estimate this step's first round is sized by
        self.engine_memory("resume_memory")          # a colocated engine gets its memory back
        for r in range(self.rounds):
            width = self.round_width(P - n_kept, P * self.rounds - drawn)
            if width == 0:                            # the step's prompts are spent
                break
            rounds += 1
            t = time.perf_counter()
            if self.overlap is not None and r == 0:   # generated while the last step trained
                idx, rb = self.overlap.take(step)
                rows, width = [self.dataset[i] for i in idx], P
            else:                                     # this rank's whole groups of the global draw
                idx = comm.my_prompts(self.draw_prompts(width, step))
                seeds = comm.group_streams(self.seed, step, drawn, width)
                rows = [self.dataset[i] for i in idx]
                rb = self.sample(rows, PromptStreams(seeds) if seeds is not None else None)
            t_roll += time.perf_counter() - t
            if rb.timing is not None:
                timings.append(rb.timing)
            if r == 0:
                staleness = self.staleness(rb, step)
            t = time.perf_counter()
            fresh = self.score(batch_lib.from_rollout(rb, idx, rows, G, step=step,
                                                      first_group=comm.first_group(drawn, width)))
            t_rew += time.perf_counter() - t
            drawn += width
            if self.curriculum is not None:
                self.scored.append(fresh)
            if self.dynamic is None:
                kept = [fresh]
                break
            good = self.dynamic(fresh, StepContext(step))
            mine, n_new, found = comm.keep_groups(len(good.groups), P - n_kept)    # the quota is the job's
            if self.keep_rate is not None:
                self.keep_rate.add(found, width)
            surplus += found - n_new
            if mine < len(good.groups):
                good = batch_lib.slice_groups(good, good.groups[:mine])
            if len(good):
                kept.append(good)
            n_kept += n_new
            if n_kept >= P:
                break
        if self.overlap is not None and step + 1 < self.steps:
            self.overlap.submit(step + 1)             # batch k+1 from weights k, while step k trains
        else:
            self.engine_memory("release_memory")      # ... and gives it to the update
        metrics = {"time/rollout": t_roll, "time/reward": t_rew, "dynamic/rounds": float(rounds),
                   "dynamic/kept_groups": float(n_kept if self.dynamic is not None else P), **staleness}
        if self.dynamic is not None:
            metrics.update({"dynamic/sampled_groups": float(drawn), "dynamic/surplus_groups": float(surplus)})
        if self.keep_rate is not None:
            metrics["dynamic/keep_rate"] = rate
        if not kept and n_kept:                       # the job's groups are all other ranks': none here
            kept = [batch_lib.select(fresh, [])]
        elif not kept:                                # nothing kept anywhere: the last round, a step's groups
            share = len(comm.my_prompts(list(range(P))))
            kept = [fresh if len(fresh.groups) <= share else batch_lib.slice_groups(fresh, fresh.groups[:share])]
        batch = batch_lib.concat(kept, self.pad_id)
        metrics.update(batch_lib.merged_reward_metrics(kept))
        if batch.episodes is not None:                # the job's sums and latencies (agreed: not reduced again)
            counts = comm.all_sum(episode_counts(batch.episodes, int(batch.action_mask.sum()), int(batch.mask.sum()),
                                                 timings))
            latencies = [x for rank in comm.gather([x for t in timings for x in t.get("tool_latencies", ())])
                         for x in rank]
            metrics.update(episode_metrics(counts, latencies))
        return batch, metrics

    def round_width(self, missing: int, budget: int) -> int:
        """Prompts to draw for a round that still needs `missing` kept groups, with `budget` prompts
        left of the step's `max_sampling_rounds` x prompts per step; at least one per rank."""
        if self.keep_rate is None:
            return min(self.P, budget)
        if budget < self.comm.world:                  # every rank takes part in every round (a sharded
            return 0                                  # policy's generation gathers its weights together)
        return max(self.comm.world, self.keep_rate.width(missing, budget, self.confidence))

    def take_scored(self) -> list[Batch]:
        """This step's scored batches, every sampled group (and no more held here)."""
        out, self.scored = self.scored, []
        return out

    def staleness(self, rb: RolloutBatch, step: int) -> dict[str, float]:
        """`rollout/staleness`: optimizer steps between the weights that sampled `rb` and the ones
        about to train on it (engines that report a weights version). Weights that have trained k
        steps are version k, so it is `step - version`: 0 on-policy, at most 1 with
        `rollout.async`; anything else means the engine sampled from weights it should not have."""
        if rb.weights_version is None:
            return {}
        staleness, allowed = step - rb.weights_version, int(self.overlap is not None)
        if not 0 <= staleness <= allowed:
            raise RuntimeError(f"step {step + 1}: the rollout engine sampled with weights version "
                               f"{rb.weights_version}, {staleness} steps behind the trainer's (allowed: {allowed})")
        return {"rollout/staleness": float(staleness)}

    def engine_memory(self, what: str) -> None:
        """Call the engine's optional `release_memory` / `resume_memory` when it has one."""
        fn = getattr(self.engine, what, None)
        if fn is not None:
            fn()

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "gen": self.gen.get_state(),
                "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
                "rollout_in_flight": self.overlap.state_dict() if self.overlap is not None else None,
                "keep_rate": asdict(self.keep_rate) if self.keep_rate is not None else None}

    def load_state_dict(self, s: dict) -> None:
        self.sampler.load_state_dict(s["sampler"])
        self.gen.set_state(s["gen"])
        if self.curriculum is not None and s.get("curriculum"):
            self.curriculum.load_state_dict(s["curriculum"])
        if self.overlap is not None:
            self.overlap.load_state_dict(s.get("rollout_in_flight"))
        if self.keep_rate is not None and s.get("keep_rate"):          # absent in checkpoints before it
            self.keep_rate = KeepRate(**s["keep_rate"])
