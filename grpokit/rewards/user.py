"""A user's own reward functions: how they are called, how config names them, what columns they need.

Three things a reward written outside grpokit needs, each checked before the model is loaded:

- **Its call.** `adapt(fn)` puts a function behind grpokit's reward signature: it is called by
  keyword when it has a `completions` parameter (TRL's `def f(completions, **kwargs)`), else as
  grpokit's `fn(prompts, completions, **columns)`, and it gets only the columns it names unless
  it takes `**kwargs`.
- **Its name in config.** A `rewards:` entry may name an importable function instead of a
  registered reward: `my_rewards:score` (module `my_rewards`, attribute `score`; the module is
  looked up on `sys.path` and in the current directory), TRL's dotted form `my_rewards.score`,
  or a file, `path/to/file.py:score`. `resolve(name)` imports it, adapts it and registers it under
  that very reference, so metrics read `reward/my_rewards:score/mean` and a run's config.yaml
  names it the same way in a later process. An import error, a missing attribute or something
  that is not a function is one line naming the reference.
- **Its dataset columns.** `required_columns(fn, args)` lists the dataset columns a reward reads:
  those a built-in declares (`register(..., columns=["{answer_column}"])`, `{arg}` standing for
  the value of its argument `arg`), else, for a user's function, its required parameters other
  than prompts / completions that config `args` do not set. `check_columns` compares them with a
  dataset's columns (after `data.prompt_field` / `data.answer_field` renaming).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Mapping

from grpokit._imports import import_reference
from grpokit._names import did_you_mean
from grpokit.errors import ConfigError

from .registry import REGISTRY, register

log = logging.getLogger("grpokit.rewards")

PASSED_COLUMNS = ("completion_length", "finish_reason", "group_id", "max_new_tokens")
"""Columns the trainer adds to every dataset row's columns when it calls a reward."""

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


# ---------------------------------------------------------------------- calling


def reward_name(fn) -> str:
    """A metric-friendly name for a callable: its own name, else its class name, else `reward`."""
    f = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(f, "__name__", None) or type(f).__name__
    name = re.sub(r"\W+", "_", str(name)).strip("_")
    return "reward" if name in ("", "lambda") else name


class Caller:
    """How a user's reward function is called: by keyword (it has a `completions` parameter, as in
    TRL) or positionally (grpokit's `fn(prompts, completions, **columns)`), with the columns it
    names (all of them when it takes **kwargs); `required` are the parameters it cannot do without
    (columns, or config `args`)."""

    def __init__(self, fn):
        try:
            params = dict(inspect.signature(fn).parameters)
        except (TypeError, ValueError):                     # no signature (a builtin): grpokit's call
            params = None
        self.all_columns = params is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.names = set() if params is None else {n for n, p in params.items() if p.kind in _NAMED}
        self.by_keyword = "completions" in self.names
        self.required: list[str] = []
        if params is None:
            return
        if self.by_keyword:
            rest = [p for n, p in params.items() if n not in ("prompts", "completions")]
        else:
            positional = [p for p in params.values() if p.kind in _POSITIONAL]
            if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
                raise ConfigError(f"reward function {reward_name(fn)!r} must take (prompts, completions, "
                                  f"**columns), or TRL's (completions, **kwargs)")
            rest = positional[2:] + [p for p in params.values() if p.kind is p.KEYWORD_ONLY]
        self.required = [p.name for p in rest if p.kind in _NAMED and p.default is p.empty]

    def __call__(self, fn, prompts, completions, columns):
        if not self.all_columns:
            columns = {k: v for k, v in columns.items() if k in self.names}
        if self.by_keyword:
            kw = {**columns, "completions": completions}
            if self.all_columns or "prompts" in self.names:
                kw["prompts"] = prompts
            return fn(**kw)
        return fn(prompts, completions, **columns)


def adapt(fn) -> Callable[..., list]:
    """`fn` behind grpokit's reward signature (see `Caller`); `inspect.signature` of the result is
    `fn`'s, so config `args` are checked against `fn`'s own parameters."""
    caller = Caller(fn)

    @functools.wraps(fn)
    def reward(prompts, completions, **columns):
        return caller(fn, prompts, completions, columns)

    reward._grpokit_caller = caller
    if getattr(fn, "required_columns", None) is None:      # copied by functools.wraps when declared
        reward.required_columns = lambda args: [n for n in caller.required if n not in args]
    return reward


# ---------------------------------------------------------------------- import references


def is_reference(name) -> bool:
    """Whether a reward name is an import reference (`module:function`, `module.function`,
    `file.py:function`) rather than a registered name."""
    return isinstance(name, str) and (":" in name or "." in name)


def resolve(name: str) -> Callable[..., list]:
    """The reward `name` names: a registered one, or the function an import reference points at,
    registered under that reference on first use. ValueError (one line) when there is none."""
    if name in REGISTRY or not is_reference(name):
        from .registry import get
        return get(name)
    fn = _import(name)
    own = getattr(fn, "own_time_limit", False)
    register(name, own_time_limit=own)(adapt(fn))
    return REGISTRY[name]


def _import(ref: str):
    def not_found(name: str) -> str:
        close = did_you_mean(ref, REGISTRY)
        return f"; not a registered reward either{close}" if close else "; use path/to/file.py:FUNCTION for a file"

    obj = import_reference(ref, "reward", target="FUNCTION", not_found=not_found)
    if not callable(obj) or isinstance(obj, type):
        attr = ref.rpartition(":")[2] if ":" in ref else ref.rpartition(".")[2]
        raise ConfigError(f"reward {ref!r}: {attr} is a {type(obj).__name__}, not a reward function")
    return obj


# ---------------------------------------------------------------------- required columns


def required_columns(fn, args: Mapping | None = None) -> list[str]:
    """The dataset columns reward `fn` reads, with its config `args`: declared ones (a list of
    column names, `{arg}` standing for the value of argument `arg`, or a callable of the args),
    else its required parameters besides prompts / completions that `args` do not set."""
    args = dict(args or {})
    declared = getattr(fn, "required_columns", None)
    if callable(declared):
        return list(declared(args))
    if declared is not None:
        defaults = {}
        try:
            defaults = {n: p.default for n, p in inspect.signature(fn).parameters.items()
                        if p.default is not p.empty}
        except (TypeError, ValueError):
            pass
        return [str(c).format_map({**defaults, **args}) for c in declared]
    try:
        caller = Caller(fn)
    except ConfigError:
        return []
    return [n for n in caller.required if n not in args]


def check_columns(specs: Iterable, rows: list[dict], what: str, fns: Mapping | None = None) -> None:
    """Every column a configured reward reads must be in the dataset `rows` (or be one the trainer
    passes): ConfigError naming the reward, the column and the columns there are. A column missing
    from some rows only is a warning (those samples score None). `fns`: name -> function for
    rewards no longer registered (default: `resolve(name)`)."""
    present: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            if v is not None:
                present[k] = present.get(k, 0) + 1
    present.pop("prompt", None)                             # passed as `prompts`, not as a column
    have = ", ".join(sorted({k for row in rows for k in row}))
    for spec in specs:
        name, args = (spec.name, spec.args) if hasattr(spec, "name") else (spec["name"], spec.get("args", {}))
        fn = fns[name] if fns is not None and name in fns else resolve(name)
        for col in required_columns(fn, args):
            if col in PASSED_COLUMNS:
                continue
            n = present.get(col, 0)
            if n == 0:
                hint = "; set data.answer_field to the column holding the answers" if col == "answer" else ""
                raise ConfigError(f"reward {name!r} needs the column {col!r}, which {what} does not have "
                                  f"(its columns: {have}){hint}")
            if n < len(rows):
                log.warning("reward %r: column %r is missing or null in %d of %d rows of %s; those "
                            "samples score None", name, col, len(rows) - n, len(rows), what)
