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

import importlib
import inspect
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from grpokit.errors import ConfigError

log = logging.getLogger("grpokit.rollout")

RESERVED = {"reset", "step", "reward", "close"}


def load_object(spec: str, what: str):
    """"package.module:name" -> the object; a one-line ConfigError when it cannot be imported."""
    module, sep, name = str(spec).partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{what} must look like package.module:Name (got {spec!r})")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError(f"{what} {spec}: cannot import {module} ({type(exc).__name__}: {exc})") from None
    try:
        return getattr(mod, name)
    except AttributeError:
        raise ConfigError(f"{what} {spec}: {module} has no {name!r}") from None


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
        else:
            fns = {}
            for fn in tools:
                if not callable(fn):
                    raise ConfigError(f"rollout.tools: {fn!r} is not a function")
                fns[getattr(fn, "__name__", repr(fn))] = fn
            self.factory = lambda: FunctionEnv(fns)
            self.text_form = False
            self.schemas = [schema_of(n, f) for n, f in sorted(fns.items())]
        self.has_reward = callable(getattr(self.factory(), "reward", None))

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
    """Runs tool calls off the decoding thread, at most `workers` at once, each bounded by
    `timeout_s`. A call that raises or runs out of time becomes an error observation (the thread of a
    timed-out call runs on in the background: a tool that can hang should run its work in a process,
    as the code sandbox does)."""

    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpokit-tool")

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        return self.pool.submit(fn, *args, **kwargs)

    def result(self, fut: Future, what: str) -> tuple[Any, str | None]:
        """(value, None), or (None, "error" | "timeout") with the error logged at debug level."""
        try:
            return fut.result(timeout=self.timeout_s), None
        except FutureTimeout:
            fut.cancel()
            return f"{what} did not answer within {self.timeout_s:g} s", "timeout"
        except Exception as exc:  # noqa: BLE001 - a failing tool is an observation, not a crash
            log.debug("%s raised", what, exc_info=True)
            return f"{what} failed: {type(exc).__name__}: {exc}", "error"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
