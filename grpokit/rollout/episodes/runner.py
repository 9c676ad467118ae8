"""Multi-turn episodes on any rollout engine: the policy writes a turn, the environment answers,
until the policy answers without a tool call, or a limit ends it.

Turns are batched (`EpisodeSettings.scheduling`): every live episode's next turn is generated in
one engine call (the first turn of a prompt's G episodes shares its prompt, `n=G`), then the turns'
tool calls all run at once in a bounded pool (grpokit.rollout.episodes.env.ToolPool), then the next
turn. With `per_episode` scheduling an episode's next turn joins the first engine call after its own
tools have answered, while other episodes' tools keep running; each episode then samples from its
own seeded stream (`turn_streams`), so what it samples does not depend on which episodes shared
its engine calls. Each episode records:

- its ids after the prompt: assistant turns exactly as sampled (with their sampler log-probs) and
  observations as template deltas (grpokit.rollout.episodes.chat), with `action_mask` 1 on the
  first and 0 on the second: observations never enter the loss, the KL or the token counts;
- why it stopped: `stop` (a turn without a tool call), `length` (the token budget, all turns and
  observations together, is `rollout.max_new_tokens`; each turn may use what remains), `max_turns`,
  `tool_error` / `timeout` (a text-form environment's `step` raised or ran out of time; a failing
  *tool* is an error observation and the episode goes on);
- its conversation, tool calls, tool errors and parse failures, the observation tokens, and the
  environment itself (its `reward()` is taken at the end).

The engine is neutral: anything with `generate(prompt_ids, params, generator)` (grpokit.rollout.base).
Each turn re-reads the whole episode (prompt + turns so far) as its prompt; the in-process engines
prefill it again.

Segments (`EpisodeSettings.segments`). With a prefix-preserving chat template an episode is one
training sequence (`whole`). A template that rewrites earlier turns when one is appended (thinking
templates that drop past reasoning) cannot give one sequence whose every turn is what the model was
shown, so with `per_turn` (chosen by `auto` for such a template, and said at start) each turn is
generated from the template's own rendering of the conversation so far and becomes its own training
sample: that prompt, the turn's ids and log-probs as sampled. The record's `segments` holds them;
the trainer turns an episode's row into its segments after scoring (grpokit.train.batch.to_segments),
each carrying the episode's one advantage.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grpokit.errors import ConfigError
from grpokit.rollout.base import PromptStreams, RolloutBatch, SamplingParams, mix_seed
from grpokit.rollout.episodes.chat import ChatTokens, NotPrefixPreserving
from grpokit.rollout.episodes.env import EnvSpec, ToolPool
from grpokit.rollout.episodes.parse import parse_tool_calls

log = logging.getLogger("grpokit.rollout")

STOP_REASONS = ("stop", "length", "max_turns", "tool_error", "timeout", "env_error")
JOIN_S = 0.02
"""Per-episode scheduling: how long an engine call waits for tools still running to answer and
join it (a tool answering in microseconds would otherwise miss the call its episode's turn ended
in, and every call would split in two)."""


@dataclass
class EpisodeSettings:
    max_turns: int = 8
    """Assistant turns per episode."""
    max_observation_tokens: int = 256
    """An observation longer than this is cut in the middle (its start and end kept)."""
    tool_timeout_s: float = 10.0
    tool_workers: int = 4
    segments: str = "auto"
    """`whole` (one sequence per episode; a non-prefix-preserving template is refused), `per_turn`
    (one training sample per assistant turn), or `auto` (`whole` when the template allows it)."""
    scheduling: str = "batched"
    """`batched`: each engine call takes every live episode's next turn, after all of the previous
    turn's tool calls are answered. `per_episode`: an episode's next turn goes into the first engine
    call after its own tools answer, so a slow tool holds up its own episode only."""


@dataclass
class _Turns:
    """What one `run`'s engine calls share and add up."""
    G: int
    params: SamplingParams
    generator: Any                      # the run's generator, or a PromptStreams (one stream per row)
    widths: list[int] = field(default_factory=list)       # live episodes per engine call
    resampled: int = 0
    versions: list[int] = field(default_factory=list)


@dataclass
class Episode:
    row: dict
    env: Any
    messages: list[dict]
    prompt_ids: list[int]
    budget: int = 0                     # tokens over all turns and observations
    ids: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    parse_failures: int = 0
    obs_tokens: int = 0
    stop_reason: str | None = None
    final: str = ""
    segments: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)
    t_generate: float = 0.0             # seconds in the engine calls that sampled its turns
    t_env: float = 0.0                  # seconds in the tool / environment calls of its turns
    t_wait: float = 0.0                 # the rest of the batch's wall time: waiting for other episodes

    def append(self, ids: list[int], logp: list[float] | None) -> None:
        self.ids += ids
        self.action += [1 if logp is not None else 0] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)
        if logp is None:
            self.obs_tokens += len(ids)

    def record(self) -> dict:
        return {"stop_reason": self.stop_reason, "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "tool_timeouts": self.tool_timeouts,
                "parse_failures": self.parse_failures,
                "obs_tokens": self.obs_tokens, "messages": self.messages, "final": self.final, "env": self.env,
                "time_generate": self.t_generate, "time_env": self.t_env, "time_wait": self.t_wait}


class EpisodeRunner:
    """Runs one episode per (row, sample) with `engine`; `run` returns them as a RolloutBatch."""

    def __init__(self, engine, tokenizer, spec: EnvSpec, settings: EpisodeSettings | None = None):
        self.engine, self.tok, self.spec = engine, tokenizer, spec
        self.settings = settings or EpisodeSettings()
        self.eos_ids = list(getattr(engine, "eos_ids", None) or [tokenizer.eos_token_id])
        self.chat = ChatTokens(tokenizer, spec.schemas, self.eos_ids)
        if self.settings.scheduling not in ("batched", "per_episode"):
            raise ConfigError(f"rollout.agent.scheduling must be batched or per_episode, "
                              f"not {self.settings.scheduling!r}")
        mode = self.settings.segments
        if mode not in ("auto", "whole", "per_turn"):
            raise ConfigError(f"rollout.agent.segments must be auto, whole or per_turn, not {mode!r}")
        preserving = mode == "per_turn" or self.chat.prefix_preserving()
        if not preserving and mode == "whole":
            raise ConfigError("the tokenizer's chat template rewrites earlier turns when a turn is appended (not "
                              "prefix-preserving), so an episode cannot be one sequence of the tokens as sampled; "
                              "set rollout.agent.segments: per_turn (one training sample per turn) or use a "
                              "template that only appends (tokenizer.chat_template)")
        self.per_turn = mode == "per_turn" or not preserving
        if self.per_turn and mode == "auto":
            log.warning("the chat template rewrites earlier turns (not prefix-preserving): each assistant turn is "
                        "trained as its own segment, with the prompt the template gave it (rollout.agent.segments)")
        self.pool = ToolPool(self.settings.tool_workers, self.settings.tool_timeout_s)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # ------------------------------------------------------------------------------ start
    def _start(self, rows: list[dict], G: int, budget: int) -> list[Episode]:
        """`G` episodes per row, their environments reset in the tool pool (off the generation path,
        within `tool_timeout_s`). An episode whose reset raises or hangs is recorded as stopped
        (`env_error`, trained as empty) and the others play on; every reset of a batch failing is
        a one-line error (the environment cannot start from these rows at all)."""
        envs = [(row, self.spec.build()) for row in rows for _ in range(G)]
        results = self.pool.run([[("the environment's reset()", lambda env=env, row=row: env.reset(**row))]
                                 for row, env in envs])
        eps, failed = [], []
        for (row, env), [(first, err)] in zip(envs, results):
            if err is not None:
                failed.append(first)
                first = None
            prompt = row.get("prompt", "") if first is None else first
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            try:
                prompt_ids = self.chat.prompt_ids(messages)
            except Exception as exc:  # noqa: BLE001 - the template cannot render this prompt
                raise _template_failed(exc) from None
            eps.append(Episode(row=row, env=env, messages=messages, prompt_ids=prompt_ids, budget=budget,
                               stop_reason="env_error" if err is not None else None))
        if failed and len(failed) == len(eps):
            raise ConfigError(f"rollout.env {type(envs[0][1]).__name__}: {failed[0]} on every row of the batch; "
                              f"row keys: {sorted(rows[0])}")
        if failed:
            log.warning("%d of %d episodes could not start and train as empty (env_error): %s",
                        len(failed), len(eps), failed[0])
        return eps

    # ------------------------------------------------------------------------------ the loop
    def run(self, rows: list[dict], params: SamplingParams, generator=None) -> RolloutBatch:
        """`params.n` episodes per row (group after group); `params.max_new_tokens` is each episode's
        budget over all its turns and observations. `generator`: the run's generator, or a
        `PromptStreams` (one stream per row: a data-parallel job's groups, whose episodes then
        sample the same whichever rank or batch plays them; `turn_streams`)."""
        G = params.n
        streams = generator if isinstance(generator, PromptStreams) else None
        if streams is not None and len(streams) != len(rows):
            raise ValueError(f"{len(streams)} prompt streams for {len(rows)} rows")
        per_episode = self.settings.scheduling == "per_episode"
        if per_episode and streams is None:
            # which episodes share an engine call depends on the tools' timing here, so every
            # episode samples from its own stream (drawn from the run's generator: still seeded)
            device = generator.device if isinstance(generator, torch.Generator) else "cpu"
            seeds = torch.randint(0, 2**62, (len(rows),), generator=generator, device=device).tolist()
            generator = PromptStreams(seeds)
        t_run = time.perf_counter()
        eps = self._start(rows, G, params.max_new_tokens)
        self.pool.take_latencies()            # the resets': not tool calls
        turns = _Turns(G=G, params=params, generator=generator)
        (self._play_per_episode if per_episode else self._play_batched)(eps, turns)
        wall = time.perf_counter() - t_run
        for e in eps:
            e.t_wait = max(wall - e.t_generate - e.t_env, 0.0)
        latencies = self.pool.take_latencies()        # the turns' calls (not the rewards' below)
        out = self._batch(eps, turns.resampled, turns.versions)
        out.timing = {"engine_calls": len(turns.widths), "turn_rows": sum(turns.widths),
                      "tool_latencies": latencies}
        return out

    def _play_batched(self, eps: list[Episode], turns: _Turns) -> None:
        """Every live episode's next turn in one engine call, then all their tool calls at once."""
        while True:
            where = [i for i, e in enumerate(eps) if e.stop_reason is None]
            if not where:
                return
            self._generate(eps, where, turns)
            live = [eps[i] for i in where if eps[i].stop_reason is None]
            calls = [self._calls(e) for e in live]
            seconds: list[float] = []
            results = self.pool.run([job for job, _ in calls], seconds)
            for e, (job, note), res, took in zip(live, calls, results, seconds):
                e.t_env += took                       # a hung call counts its timeout
                self._answer(e, job, note, res)

    def _play_per_episode(self, eps: list[Episode], turns: _Turns) -> None:
        """An episode's next turn is generated as soon as its tools have answered: each engine call
        takes the episodes ready then, and the others' tools keep running beside it."""
        done: queue.Queue = queue.Queue()              # (episode, job, notes, results, seconds)
        ready, running = [i for i, e in enumerate(eps) if e.stop_reason is None], 0

        def tools(i: int, job: list, note: list | None) -> None:
            seconds: list[float] = []
            try:
                res = self.pool.run([job], seconds)[0]
            except BaseException as exc:  # noqa: BLE001 - never leave the loop waiting for this episode
                res, seconds = [(f"the tool pool failed: {type(exc).__name__}: {exc}", "error")] * len(job), [0.0]
            done.put((i, job, note, res, seconds[0] if seconds else 0.0))

        while ready or running:
            got = [] if ready else [done.get()]       # the pool's timeouts bound this wait
            until = time.monotonic() + JOIN_S         # tools answering within JOIN_S join this call
            while len(got) < running:
                try:
                    got.append(done.get(timeout=max(until - time.monotonic(), 0.0)))
                except queue.Empty:
                    break
            for i, job, note, res, took in got:
                running -= 1
                eps[i].t_env += took
                self._answer(eps[i], job, note, res)
                if eps[i].stop_reason is None:
                    ready.append(i)
            if not ready:
                continue
            where, ready = sorted(ready), []
            self._generate(eps, where, turns)
            for i in where:
                if eps[i].stop_reason is not None:
                    continue
                job, note = self._calls(eps[i])
                running += 1
                if job:
                    threading.Thread(target=tools, args=(i, job, note), name="grpokit-episode", daemon=True).start()
                else:                                 # nothing to run: answered with the next results
                    done.put((i, job, note, [], 0.0))

    def _generate(self, eps: list[Episode], where: list[int], turns: _Turns) -> None:
        """One engine call: the next turn of episodes `where` (live ones), appended to each; an
        episode whose turn did not end with an end-of-turn token stops (`length`). A whole batch's
        first turn is one request per row, n = G."""
        G, budget, generator = turns.G, turns.params.max_new_tokens, turns.generator
        live = [eps[i] for i in where]
        one = replace(turns.params, n=1, max_new_tokens=max(budget - len(e.ids) for e in live))
        rows = len(eps) // G
        shared = (not turns.widths and len(live) == len(eps)
                  and all(eps[i * G].prompt_ids == eps[i * G + k].prompt_ids for i in range(rows) for k in range(G)))
        t = time.perf_counter()
        if shared:
            contexts = None
            out = self.engine.generate([eps[i * G].prompt_ids for i in range(rows)], replace(one, n=G), generator)
        else:
            contexts = [self._context(e) for e in live]
            gen = (turn_streams(generator, where, G, [e.turns for e in live])
                   if isinstance(generator, PromptStreams) else generator)
            out = self.engine.generate(contexts, one, gen)
        t_gen = time.perf_counter() - t
        turns.widths.append(len(live))
        turns.resampled += int(out.resampled)
        if out.weights_version is not None:
            turns.versions.append(int(out.weights_version))
        lengths = out.completion_mask.sum(-1).tolist()
        for k, e in enumerate(live):
            n = min(int(lengths[k]), budget - len(e.ids))
            ids, logp = out.completion_ids[k, :n].tolist(), out.sampler_logprobs[k, :n].tolist()
            if self.per_turn:
                e.segments.append((e.prompt_ids if shared else contexts[k], ids, logp))
            e.append(ids, logp)
            e.turns += 1
            e.t_generate += t_gen
            e.final = self.tok.decode(ids[:-1] if ids and ids[-1] in self.eos_ids else ids)
            e.messages.append({"role": "assistant", "content": e.final})
            ended = bool(ids) and ids[-1] in self.eos_ids and (out.finish_reason[k] == "eos")
            if not ended:
                e.stop_reason = "length"

    def _context(self, e: Episode) -> list[int]:
        """The prompt of an episode's next turn: its ids so far, or (per-turn segments) the
        template's rendering of the conversation so far with the assistant header."""
        if not self.per_turn:
            return e.prompt_ids + e.ids
        try:
            return self.chat.prompt_ids(e.messages)
        except Exception as exc:  # noqa: BLE001 - the template cannot render this conversation
            raise _template_failed(exc) from None

    def _calls(self, e: Episode) -> tuple[list, list | None]:
        """The calls an episode's last turn asks for, as a pool job, and the answers known without
        running anything (an unknown tool, an unreadable call); a turn with no call stops it."""
        if self.spec.text_form:
            return [("the environment's step()", lambda: e.env.step(e.final))], None
        parsed = parse_tool_calls(e.final)
        if not parsed.has_call:
            e.stop_reason = "stop"
            return [], None
        if parsed.error is not None:
            e.parse_failures += 1
            return [], [(None, f"Could not read the tool call: {parsed.error}.")]
        tools = EnvSpec.tools(e.env)
        job, note = [], []
        for call in parsed.calls:
            e.tool_calls += 1
            fn = tools.get(call.name)
            if fn is None:
                e.tool_errors += 1
                note.append((call.name, f"There is no tool {call.name!r} (tools: {', '.join(sorted(tools))})."))
            else:
                job.append((f"tool {call.name}", lambda fn=fn, a=call.arguments: fn(**a)))
        return job, note

    def _answer(self, e: Episode, job: list, note: list | None, res: list) -> None:
        """Append an episode's observation from its calls' results `res` (ToolPool.run's, per
        call), or its stop reason."""
        if e.stop_reason is not None:
            return
        if self.spec.text_form:
            value, err = res[0]
            if err is not None:
                e.stop_reason = "timeout" if err == "timeout" else "tool_error"
                log.debug("episode stopped: %s", value)
            elif value is None:
                e.stop_reason = "stop"
            else:
                self._append(e, [{"role": "user", "content": self._cut(_text(value))}])
            return
        answers = list(note or [])
        for (label, _), (value, err) in zip(job, res):
            if err is not None:
                e.tool_errors += 1
                e.tool_timeouts += err == "timeout"
            answers.append((label.removeprefix("tool "), self._cut(_text(value))))
        self._append(e, self.chat.observations(answers))

    def _append(self, e: Episode, msgs: list[dict]) -> None:
        """Append the observation messages' template delta, or end the episode (`max_turns`, `length`)."""
        if e.turns >= self.settings.max_turns:
            e.stop_reason = "max_turns"
            return
        try:
            delta = self.chat.observation_ids(e.messages, msgs, e.ids[-1] if e.ids else None, strict=not self.per_turn)
        except NotPrefixPreserving as exc:
            raise ConfigError(f"multi-turn episode: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the template cannot render this conversation
            raise _template_failed(exc) from None
        if len(e.ids) + len(delta) >= e.budget:       # no room left for a turn
            e.stop_reason = "length"
            return
        e.append(delta, None)
        e.messages += msgs

    def _cut(self, text: str) -> str:
        """An observation cut in the middle to `max_observation_tokens` tokens."""
        cap = self.settings.max_observation_tokens
        ids = self.chat.encode(text)
        if len(ids) <= cap:
            return text
        half = cap // 2
        return (self.tok.decode(ids[:half]) + f" [... {len(ids) - 2 * half} tokens cut ...] "
                + self.tok.decode(ids[len(ids) - half:]))

    # ------------------------------------------------------------------------------ the batch
    def _batch(self, eps: list[Episode], resampled: int, versions: list[int]) -> RolloutBatch:
        N, L = len(eps), max(max(len(e.ids) for e in eps), 1)
        ids = torch.full((N, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, L), dtype=torch.long)
        action = torch.zeros((N, L), dtype=torch.long)
        logp = torch.zeros((N, L), dtype=torch.float32)
        for i, e in enumerate(eps):
            n = len(e.ids)
            ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
            mask[i, :n] = 1
            action[i, :n] = torch.tensor(e.action, dtype=torch.long)
            logp[i, :n] = torch.tensor(e.logp, dtype=torch.float32)
            if e.stop_reason is None:                 # cannot happen: every loop iteration ends some
                e.stop_reason = "length"
        records = [e.record() for e in eps]
        if self.per_turn:
            for r, e in zip(records, eps):
                r["segments"] = e.segments
        rewards = (self.pool.run([[("the environment's reward()", e.env.reward)] for e in eps])
                   if self.spec.has_reward else [[(None, None)] for _ in eps])
        for r, [(value, err)] in zip(records, rewards):
            r["env_reward"] = None if err is not None else _number(value)
            if err is not None:
                log.warning("%s", value)
        return RolloutBatch(
            prompt_ids=[e.prompt_ids for e in eps], completion_ids=ids, completion_mask=mask,
            sampler_logprobs=logp, finish_reason=["eos" if e.stop_reason == "stop" else "length" for e in eps],
            completions=[self.tok.decode(e.ids, skip_special_tokens=False) for e in eps],
            action_mask=action, episodes=records, resampled=resampled,
            weights_version=min(versions) if versions else None)

    def close(self) -> None:
        self.pool.close()


def turn_streams(streams: PromptStreams, episodes: list[int], G: int, turns: list[int]) -> PromptStreams:
    """One stream per episode call: episode `episodes[k]` (its position, G per row) on its call
    `turns[k]`, seeded from (its row's seed, its place in the group, the call) alone, so an episode
    samples the same whichever other episodes are live, share its batch or its rank. (The
    environment loop's first turn is one request per row, n = G, on the row's own stream.)"""
    return PromptStreams([mix_seed(streams.seeds[i // G], i % G, t) for i, t in zip(episodes, turns)])


def _template_failed(exc: Exception) -> ConfigError:
    return ConfigError(f"multi-turn episode: the chat template failed on the conversation "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


def _number(value) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        log.warning("the environment's reward() returned %r, not a number", value)
        return None


def _text(value) -> str:
    """A tool's answer as text (an answer whose str() fails is an error message)."""
    try:
        return value if isinstance(value, str) else str(value)
    except Exception as exc:  # noqa: BLE001 - a broken __str__ is the tool's fault, not the step's
        return f"the tool's answer could not be shown as text ({type(exc).__name__})"
