"""Agent loops the user owns (`rollout.agent.loop: my_agent:run`): the user's function plays one
episode against a token-level engine handle and says what to train on.

    from grpokit.rollout.episodes import Trajectory

    def run(engine, row):
        prompt = engine.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
        first = engine.generate(prompt)                     # .ids, .logprobs, .finish_reason
        obs = engine.tokenizer.encode("...", add_special_tokens=False)
        second = engine.generate(prompt + first.ids + obs)
        return Trajectory(prompt_ids=prompt, ids=first.ids + obs + second.ids,
                          mask=[1] * len(first.ids) + [0] * len(obs) + [1] * len(second.ids),
                          logprobs=first.logprobs + [0.0] * len(obs) + second.logprobs,
                          completion=engine.tokenizer.decode(second.ids, skip_special_tokens=True))

A function may return several `Trajectory`s (segments of one episode, each with its own prompt:
a loop that rewrites or summarises its history); they share the episode's one reward and
advantage, as step-wise turns do (grpokit.train.batch.to_segments).

How it runs: one thread per episode (`params.n` per row), and each `engine.generate` waits until
every live episode is either waiting in `generate` or finished; then all their requests go to the
engine in one batched call, in episode order (so seeded runs repeat). An episode that neither asks
nor finishes within `rollout.agent.tool_timeout_s` is left behind (`timeout`); a function that
raises is recorded (`tool_error`) and the step goes on; an episode's generated tokens over all its
calls are capped by `rollout.max_new_tokens`. What a function returns is checked: every token it
marks as trained (mask 1) must be a token the engine sampled for that episode, with the log-prob
the engine gave it. An observation left in the loss is an error, not a silent wrong update.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grpokit.errors import ConfigError
from grpokit.rollout.base import PromptStreams, RolloutBatch, SamplingParams
from grpokit.rollout.episodes.runner import turn_streams

log = logging.getLogger("grpokit.rollout")


@dataclass
class Sampled:
    """One `generate` answer: the tokens the engine sampled and their sampler log-probs."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str                  # "eos" | "length"


@dataclass
class Trajectory:
    """What an agent loop trains on: `ids` after `prompt_ids`, `mask` 1 on the tokens the policy
    sampled (their `logprobs` as `generate` gave them) and 0 on everything else (observations)."""

    prompt_ids: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    completion: str | None = None       # the text the reward functions score (default: the last trained span)
    reward: float | None = None         # the episode's own reward (the `env` reward function reads it)
    stop_reason: str | None = None      # default: "length" when the last generate ran out of budget, else "stop"
    info: dict = field(default_factory=dict)   # tool_calls / tool_errors counts, messages, anything else


class _Abandoned(Exception):
    """Raised in an episode's thread whose episode the runner has stopped waiting for."""


class EngineHandle:
    """An episode's view of the engine: `generate(prompt_ids)` and the `tokenizer`."""

    def __init__(self, hub: _Hub, index: int, tokenizer):
        self._hub, self._index, self.tokenizer = hub, index, tokenizer
        self.outputs: list[Sampled] = []

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> Sampled:
        """Sample one continuation of `prompt_ids` (at the run's temperature) within what remains of
        the episode's token budget."""
        if not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            raise ValueError("generate needs a non-empty list of token ids")
        left = self._hub.budget - sum(len(o.ids) for o in self.outputs)
        want = left if max_new_tokens is None else min(int(max_new_tokens), left)
        out = Sampled([], [], "length") if want <= 0 else self._hub.request(self._index, list(prompt_ids), want)
        self.outputs.append(out)
        return out


class _Hub:
    """Gathers the episodes' generate requests into batched engine calls."""

    def __init__(self, engine, params: SamplingParams, generator, n: int, wait_s: float):
        self.engine, self.params, self.generator = engine, params, generator
        self.budget, self.n, self.wait_s = params.max_new_tokens, n, wait_s
        self.cv = threading.Condition()
        self.pending: dict[int, tuple[list[int], int]] = {}
        self.results: dict[int, Sampled] = {}
        self.finished: set[int] = set()
        self.abandoned: set[int] = set()
        self.calls = 0
        self.per_episode = [0] * n             # generate calls each episode has made (its streams' turn)

    def request(self, i: int, prompt: list[int], want: int) -> Sampled:
        with self.cv:
            if i in self.abandoned:
                raise _Abandoned()
            if i in self.pending:
                raise RuntimeError("an episode's engine handle takes one generate call at a time")
            self.pending[i] = (prompt, want)
            self.cv.notify_all()
            while i not in self.results:
                if i in self.abandoned:
                    raise _Abandoned()
                self.cv.wait()
            return self.results.pop(i)

    def finish(self, i: int) -> None:
        with self.cv:
            self.finished.add(i)
            self.cv.notify_all()

    def serve(self) -> None:
        """Batch requests until every episode has finished or been abandoned."""
        while True:
            with self.cv:
                deadline = time.monotonic() + self.wait_s
                while True:
                    live = set(range(self.n)) - self.finished - self.abandoned
                    if not live:
                        return
                    if live <= set(self.pending):
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:             # episodes that neither ask nor finish: stop waiting
                        self.abandoned |= live - set(self.pending)
                        self.cv.notify_all()
                        break
                    self.cv.wait(left)
                batch = sorted(self.pending.items())
                self.pending.clear()
            if not batch:
                continue
            want = max(m for _, (_, m) in batch)
            gen = self.generator
            if isinstance(gen, PromptStreams):     # a data-parallel job's groups: per episode and call
                who = [i for i, _ in batch]
                gen = turn_streams(gen, who, self.n // len(gen), [self.per_episode[i] for i in who])
            for i, _ in batch:
                self.per_episode[i] += 1
            try:
                out = self.engine.generate([p for _, (p, _) in batch], replace(self.params, n=1, max_new_tokens=want),
                                           gen)
            except BaseException:
                with self.cv:                 # no episode waits on an engine that has failed
                    self.abandoned |= set(range(self.n)) - self.finished
                    self.cv.notify_all()
                raise
            self.calls += 1
            lengths = out.completion_mask.sum(-1).tolist()
            with self.cv:
                for k, (i, (_, m)) in enumerate(batch):
                    n = min(int(lengths[k]), m)
                    fin = out.finish_reason[k] if n == int(lengths[k]) else "length"
                    self.results[i] = Sampled(out.completion_ids[k, :n].tolist(),
                                              out.sampler_logprobs[k, :n].tolist(), fin)
                self.cv.notify_all()


class LoopRunner:
    """Runs a user's agent loop `fn(engine, row) -> Trajectory | list[Trajectory]` for `params.n`
    episodes per row; `run` returns them as a RolloutBatch of episode rows (segments in the
    records' `segments`, trained one row each)."""

    per_turn = True                      # records may hold segments: the trainer expands them

    def __init__(self, engine, tokenizer, fn, *, wait_s: float = 10.0, name: str = "rollout.agent.loop"):
        self.engine, self.tok, self.fn, self.wait_s, self.name = engine, tokenizer, fn, wait_s, name
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(self, rows: list[dict], params: SamplingParams, generator=None) -> RolloutBatch:
        G = params.n
        eps = [row for row in rows for _ in range(G)]
        hub = _Hub(self.engine, params, generator, len(eps), self.wait_s)
        handles = [EngineHandle(hub, i, self.tok) for i in range(len(eps))]
        got: list[Any] = [None] * len(eps)
        errors: list[str | None] = [None] * len(eps)

        def play(i: int) -> None:
            try:
                got[i] = self.fn(handles[i], dict(eps[i]))
            except _Abandoned:
                pass
            except Exception as exc:  # noqa: BLE001 - one failing episode must not end the step
                errors[i] = f"{type(exc).__name__}: {exc}"
            finally:
                hub.finish(i)

        threads = [threading.Thread(target=play, args=(i,), daemon=True, name=f"grpokit-agent-{i}")
                   for i in range(len(eps))]
        for t in threads:
            t.start()
        hub.serve()
        for i in sorted(hub.abandoned):
            errors[i] = errors[i] or "timeout"
        failed = [e for e in errors if e is not None]
        if failed and len(failed) == len(eps):
            raise ConfigError(f"{self.name}: every episode failed (first: {failed[0]})")
        for e in dict.fromkeys(e for e in failed if e != "timeout"):
            log.warning("%s: an episode failed and is trained as empty: %s", self.name, e)
        records, rows_out = [], []
        for i in range(len(eps)):
            segs = [] if errors[i] is not None else self._check(got[i], handles[i], i)
            records.append(self._record(segs, handles[i], errors[i]))
            rows_out.append(segs)
        return self._batch(rows_out, records, hub.calls)

    # ------------------------------------------------------------------------------ checks
    def _check(self, value, handle: EngineHandle, i: int) -> list[Trajectory]:
        segs = value if isinstance(value, (list, tuple)) else [value]
        if not segs or not all(isinstance(s, Trajectory) for s in segs):
            raise ConfigError(f"{self.name} must return a Trajectory or a list of them, not {type(value).__name__}")
        where = _positions(handle.outputs)
        for k, s in enumerate(segs):
            n = len(s.ids)
            if len(s.mask) != n or len(s.logprobs) != n:
                raise ConfigError(f"{self.name}: segment {k} has {n} ids, {len(s.mask)} mask values and "
                                  f"{len(s.logprobs)} log-probs (they must match)")
            if not s.prompt_ids or any(m not in (0, 1) for m in s.mask):
                raise ConfigError(f"{self.name}: segment {k} needs a non-empty prompt_ids and a 0/1 mask")
            for lo, hi in _runs(s.mask):
                if not _sampled(s.ids[lo:hi], s.logprobs[lo:hi], where):
                    raise ConfigError(f"{self.name}: segment {k}'s tokens {lo}-{hi - 1} are marked trained (mask 1) "
                                      "but are not tokens the engine sampled for this episode with those log-probs; "
                                      "observations and other inserted tokens must have mask 0")
        return list(segs)

    def _record(self, segs: list[Trajectory], handle: EngineHandle, error: str | None) -> dict:
        last = segs[-1] if segs else None
        text = ""
        if last is not None:
            text = last.completion if last.completion is not None else self._last_trained_text(last)
        out_of_budget = bool(handle.outputs) and handle.outputs[-1].finish_reason == "length"
        stop = ("timeout" if error == "timeout" else "tool_error" if error is not None
                else (last.stop_reason or ("length" if out_of_budget else "stop")))
        info = dict(last.info) if last is not None else {}
        obs = sum(len(s.ids) - sum(s.mask) for s in segs)
        return {"stop_reason": stop, "turns": len(handle.outputs), "tool_calls": int(info.get("tool_calls", 0)),
                "tool_errors": int(info.get("tool_errors", 0)), "tool_timeouts": 0, "parse_failures": 0,
                "obs_tokens": obs, "messages": info.get("messages", []), "final": text, "env": None,
                "env_reward": last.reward if last is not None else None, "error": error,
                **({"segments": [(s.prompt_ids, s.ids, s.logprobs, s.mask) for s in segs]} if len(segs) > 1 else {})}

    def _last_trained_text(self, s: Trajectory) -> str:
        runs = _runs(s.mask)
        if not runs:
            return ""
        lo, hi = runs[-1]
        return self.tok.decode(s.ids[lo:hi], skip_special_tokens=True)

    # ------------------------------------------------------------------------------ the batch
    def _batch(self, segs_per_ep: list[list[Trajectory]], records: list[dict], calls: int) -> RolloutBatch:
        seqs = [[t for s in segs for t in s.ids] for segs in segs_per_ep]
        N, L = len(seqs), max(max((len(x) for x in seqs), default=1), 1)
        ids = torch.full((N, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, L), dtype=torch.long)
        action = torch.zeros((N, L), dtype=torch.long)
        logp = torch.zeros((N, L), dtype=torch.float32)
        for i, segs in enumerate(segs_per_ep):
            n = len(seqs[i])
            if n:
                ids[i, :n] = torch.tensor(seqs[i], dtype=torch.long)
                mask[i, :n] = 1
                action[i, :n] = torch.tensor([m for s in segs for m in s.mask], dtype=torch.long)
                logp[i, :n] = torch.tensor([x for s in segs for x in s.logprobs], dtype=torch.float32)
        prompts = [segs[0].prompt_ids if segs else [self.pad_id] for segs in segs_per_ep]
        return RolloutBatch(
            prompt_ids=prompts, completion_ids=ids, completion_mask=mask, sampler_logprobs=logp,
            finish_reason=["length" if r["stop_reason"] == "length" else "eos" for r in records],
            completions=[self.tok.decode(x, skip_special_tokens=False) for x in seqs],
            action_mask=action * mask, episodes=records)

    def close(self) -> None:
        close = getattr(self.fn, "close", None)          # an OpenAI-compatible endpoint (gateway.py) stops
        if close is not None:
            close()


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) spans of consecutive 1s."""
    out, lo = [], None
    for j, m in enumerate(list(mask) + [0]):
        if m and lo is None:
            lo = j
        elif not m and lo is not None:
            out.append((lo, j))
            lo = None
    return out


def _positions(outputs: list[Sampled]) -> dict[int, list[tuple[Sampled, int]]]:
    """Token id -> the (answer, position) pairs holding it."""
    where: dict[int, list[tuple[Sampled, int]]] = {}
    for o in outputs:
        for start, t in enumerate(o.ids):
            where.setdefault(t, []).append((o, start))
    return where


def _sampled(ids: list[int], lps: list[float], where: dict[int, list[tuple[Sampled, int]]]) -> bool:
    """True when `ids` (with `lps`) is made of contiguous pieces of the engine's answers (one answer,
    or answers that continue one another), matched longest piece first. Only the places where an
    answer holds the piece's next token are tried, so long episodes stay cheap."""
    j, n = 0, len(ids)
    while j < n:
        best = 0
        for o, start in where.get(ids[j], ()):
            k = 0
            while (j + k < n and start + k < len(o.ids) and o.ids[start + k] == ids[j + k]
                   and abs(o.logprobs[start + k] - lps[j + k]) <= 1e-5):
                k += 1
            best = max(best, k)
        if best == 0:
            return False
        j += best
    return True
