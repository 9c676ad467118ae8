"""Environments and tools: what an episode talks to.

An environment is a plain class, built once per episode: `reset(**row)` receives the dataset row and
returns the first observation (a string: the user's message; a list of chat messages; or None: the
row's own `prompt`). Its public methods are its tools: typed, with a Google-style docstring (what
the tool does, and an `Args:` line per argument), from which the JSON schema the model sees is made
by `transformers.utils.get_json_schema`. Optional:

- `reward(self) -> float`: a reward from the environment's own state at the episode's end (the
  `env` reward function reads it; ordinary reward functions get the environment as the `env`
  column too);
- `step(self, text) -> str | None`: the text form, for environments without tool calls (a game that
  answers "higher" / "lower"): every assistant turn's text goes to `step`, which answers with the
  next observation, or None to end the episode. An environment has tools or `step`, not both.

Plain tool functions (`rollout.tools`, `GRPO(tools=[fn])`) are the same without a class or state.

    class CalcEnv:
        def reset(self, **row):
            self.answer = row["answer"]
            return None                                   # the row's prompt

        def calculator(self, expression: str) -> str:
            '''Evaluate an arithmetic expression.

            Args:
                expression: digits, + - * / and parentheses, e.g. "(12 + 3) * 4"
            '''
            return str(evaluate(expression))
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Any, Callable

from grpokit._imports import import_reference
from grpokit.errors import ConfigError

log = logging.getLogger("grpokit.rollout")

RESERVED = {"reset", "step", "reward", "close"}


def load_object(spec: str, what: str):
    """The object an import reference (`package.module:Name`, `path/to/file.py:Name`) points at,
    as reward references are resolved (grpokit._imports); a one-line ConfigError otherwise."""
    return import_reference(spec, what)


def tools_of(env) -> dict[str, Callable]:
    """The public methods of an environment instance that are its tools (not reset/step/reward/close)."""
    out = {}
    for name, fn in inspect.getmembers(type(env), callable):
        if name.startswith("_") or name in RESERVED or isinstance(inspect.getattr_static(type(env), name), type):
            continue
        out[name] = getattr(env, name)
    return out


def schema_of(name: str, fn: Callable) -> dict:
    """The OpenAI-style tool schema of `fn` (its signature and docstring); ConfigError naming what
    is missing when the docstring does not describe every argument."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
        raise ConfigError(f"tool {name}: {str(exc).splitlines()[0]} (a tool needs type hints and a docstring with "
                          "an Args: line per argument)") from None
    schema["function"]["name"] = name
    schema["function"].pop("return", None)
    return schema


class FunctionEnv:
    """An environment of plain tool functions and no state (`rollout.tools`)."""

    def __init__(self, tools: dict[str, Callable]):
        self._tools = dict(tools)

    def reset(self, **row):
        return None

    def tools(self) -> dict[str, Callable]:
        return dict(self._tools)


class EnvSpec:
    """How to build an episode's environment, and what it offers: its tools (name -> schema) or the
    text form (`step`)."""

    def __init__(self, factory: Callable[[], Any] | None = None, tools: list[Callable] | None = None):
        if factory is None and not tools:
            raise ConfigError("an episode needs an environment (rollout.env) or tools (rollout.tools)")
        if factory is not None and tools:
            raise ConfigError("give rollout.env or rollout.tools, not both (an environment's tools are its methods)")
        if factory is not None:
            if not callable(factory):
                raise ConfigError(f"rollout.env {factory!r} is not a class (or a function that builds one)")
            probe = factory()
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"rollout.env {type(probe).__name__} has no reset(**row) method")
            names = tools_of(probe)
            self.text_form = callable(getattr(probe, "step", None))
            if self.text_form and names:
                raise ConfigError(f"rollout.env {type(probe).__name__} has both step() and tools "
                                  f"({', '.join(sorted(names))}): an environment answers text or tool calls, not both")
            if not self.text_form and not names:
                raise ConfigError(f"rollout.env {type(probe).__name__} has no tools (public methods) and no step(text)")
            self.factory = factory
            self.schemas = [schema_of(n, f) for n, f in sorted(names.items())]
            self.has_reward = callable(getattr(probe, "reward", None))
        else:
            fns = {}
            for fn in tools:
                if not callable(fn):
                    raise ConfigError(f"rollout.tools: {fn!r} is not a function")
                fns[getattr(fn, "__name__", repr(fn))] = fn
            self.factory = lambda: FunctionEnv(fns)
            self.text_form, self.has_reward = False, False
            self.schemas = [schema_of(n, f) for n, f in sorted(fns.items())]

    @classmethod
    def from_config(cls, env: str | None, tools: list[str]) -> "EnvSpec":
        factory = load_object(env, "rollout.env") if env else None
        fns = [load_object(t, "rollout.tools") for t in tools]
        return cls(factory, fns or None)

    def build(self):
        return self.factory()

    @staticmethod
    def tools(env) -> dict[str, Callable]:
        return env.tools() if isinstance(env, FunctionEnv) else tools_of(env)


class ToolPool:
    """Runs tool calls off the decoding thread. Each episode's calls of a turn are one job, run in
    order on a thread of its own (an environment instance never runs two calls at once); at most
    `workers` calls run at a time, and each call has `timeout_s` from when it starts running (a call
    waiting for a worker is not charged, so a few hung tools cannot time out the healthy calls
    queued behind them); a call not done by then is an error observation, and the calls after it in
    its job are not run. Threads are daemons: a tool that never returns cannot hold the process at
    exit. A thread cannot be killed, so a hung call keeps running in the background (`hung` counts
    them, and their worker slots are given back at their deadline so the pool does not fill up); a
    tool that can hang or runs untrusted code should do its work in a process, as the code sandbox
    does. A turn whose calls all hang takes about ceil(calls / workers) x `timeout_s`."""

    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        self.slots = threading.Semaphore(workers)
        self.hung = 0
        self.latencies: list[float] = []      # seconds of each finished call (timeouts at the timeout)
        self._lat_lock = threading.Lock()

    def take_latencies(self) -> list[float]:
        """The calls' latencies since the last take (what `agent/tool_latency_*` report)."""
        with self._lat_lock:
            out, self.latencies = self.latencies, []
        return out

    def run(self, jobs: list[list[tuple[str, Callable[[], Any]]]],
            seconds: list[float] | None = None) -> list[list[tuple[Any, str | None]]]:
        """For each job (a list of (label, call) pairs), each call's (value, None) or (message,
        "error" | "timeout"). `seconds`, when given, gets each job's time in its calls (a call
        that timed out counts its timeout)."""
        boxes = [[None] * len(job) for job in jobs]
        states = [{"holding": False, "since": 0.0, "abandoned": False, "done": False, "took": 0.0} for _ in jobs]
        cv = threading.Condition()

        def work(job, box, st):
            try:
                for k, (label, fn) in enumerate(job):
                    self.slots.acquire()
                    with cv:
                        st["holding"], st["since"] = True, time.monotonic()
                        cv.notify_all()               # the waiter learns this call's deadline
                    try:
                        box[k] = (fn(), None)
                    except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, not a crash
                        log.debug("%s raised", label, exc_info=True)
                        box[k] = (f"{label} failed: {type(exc).__name__}: {exc}", "error")
                    with cv:
                        if st["abandoned"]:           # timed out: the waiter gave the slot back already
                            return
                        st["holding"] = False
                        self.slots.release()
                        st["took"] += time.monotonic() - st["since"]
                        self._latency(time.monotonic() - st["since"])
            finally:
                with cv:
                    st["done"] = True
                    cv.notify_all()

        for job, box, st in zip(jobs, boxes, states):
            threading.Thread(target=work, args=(job, box, st), name="grpokit-tool", daemon=True).start()
        with cv:
            while True:
                now, wake, freed = time.monotonic(), None, False
                pending = [st for st in states if not st["done"] and not st["abandoned"]]
                if not pending:
                    break
                for st in pending:
                    if not st["holding"]:
                        continue
                    deadline = st["since"] + self.timeout_s
                    if now >= deadline:               # a hung call: its slot back, it runs on beside the pool
                        st["abandoned"], st["holding"], freed = True, False, True
                        self.hung += 1
                        self.slots.release()
                        st["took"] += self.timeout_s
                        self._latency(self.timeout_s)
                    else:
                        wake = deadline if wake is None else min(wake, deadline)
                if not freed:                         # else look again: that may have been the last one
                    cv.wait(None if wake is None else max(wake - now, 0.001))
        if seconds is not None:
            seconds[:] = [st["took"] for st in states]
        return [[box[k] if box[k] is not None else (f"{label} did not answer within {self.timeout_s:g} s", "timeout")
                 for k, (label, _) in enumerate(job)] for job, box in zip(jobs, boxes)]

    def _latency(self, seconds: float) -> None:
        with self._lat_lock:
            self.latencies.append(seconds)

    def close(self) -> None:
        """Nothing to stop: the threads are daemons."""
