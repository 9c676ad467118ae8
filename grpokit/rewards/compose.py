"""Weighted composition of registered rewards, with containment and cross-checking.

    total_i = sum_k weight_k * r_k(i)        (NaN when any r_k(i) is None: the trainer excludes
                                              the sample from group statistics, advantage 0)

Containment: a reward that raises (anything but KeyboardInterrupt, `sys.exit()` included),
returns the wrong number of values or a non-number, or runs past its `timeout_s` scores None for
that call's samples, counts them in `reward/<name>/errors`, and logs its first traceback once
(logger `grpokit.rewards`). Training never stops for it. `timeout_s: "auto"` (the default) is
`DEFAULT_TIMEOUT_S` (300 s per call) for a plain reward, and no budget for one registered with
`own_time_limit=True` (math_accuracy, math_accuracy_alt, code_tests): those bound every sample
themselves and score an overrun as a wrong answer, while a budget over the whole batch would score
a batch of slow pathological answers None (advantage 0, no penalty) and abandon a thread still
using their checkers. A reward with a budget runs in a daemon thread; a timed out one keeps
running there, abandoned (Python cannot kill a thread). `timeout_s: null` runs a reward in the
caller's thread with no budget (needed by a reward that sets signal handlers, which only the main
thread may do).

Cross-checking (`CrossCheck`): on a random `fraction` of the samples the primary reward's scores
are compared with an independent checker (a registered reward such as `math_accuracy_alt`, or any
callable with the reward signature, e.g. an LLM judge); `reward/checker_disagreement` is the
fraction of compared samples where they differ, and those samples are appended to `dump_path` as
JSON lines.

Metrics (all floats, per `score` call):
    reward/<name>/mean         mean over the samples it scored (NaN if none)
    reward/<name>/errors       samples that lost their score to a failure of <name> (raise,
                               timeout, malformed return): the batch size or 0
    reward/<name>/none_frac    fraction of samples without a score (errors and None returns)
    reward/total_nan_frac      fraction of samples whose total is NaN
    reward/checker_disagreement   fraction of compared samples where checker and primary differ
    reward/checker_checked     samples compared (both scores present)
    reward/checker/errors      samples lost to a failure of the checker
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import numbers
import os
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from grpokit._names import did_you_mean

from .user import resolve

logger = logging.getLogger("grpokit.rewards")

DEFAULT_TIMEOUT_S = 300.0
"""Default time budget of one reward call (all samples of the batch) and of one checker call: a
custom reward that hangs costs at most this per step instead of stalling training forever. Not
applied by default to a reward registered with `own_time_limit=True` (see `resolve_timeout`)."""

AUTO = "auto"


def resolve_timeout(timeout_s, fn) -> float | None:
    """The budget a spec's `timeout_s` means for `fn`: "auto" is no budget for a reward that
    declares its own per-sample limits (`own_time_limit`), else `DEFAULT_TIMEOUT_S`; a number or
    None (no budget) is taken as given."""
    if timeout_s == AUTO:
        return None if getattr(fn, "own_time_limit", False) else DEFAULT_TIMEOUT_S
    return timeout_s


def check_timeout(v):
    """The one validator of a `timeout_s` setting (reward specs, cross-checks, their config
    sections): a finite number > 0 (returned as a float), None (no budget) or "auto"."""
    if v is None or v == AUTO:
        return v
    if isinstance(v, (str, bool)) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"timeout_s must be a number > 0, null or 'auto' (got {v!r})")
    return float(v)


TimeoutS = Annotated[float | None | Literal["auto"], AfterValidator(check_timeout)]
"""A `timeout_s` field: validated by `check_timeout`, resolved against the function by
`resolve_timeout`."""


class RewardSpec(BaseModel):
    """One entry of `rewards:` in config, e.g. `{name: soft_overlong, weight: 1.0, args: {max_len: 64}}`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """Registered reward name (see `grpokit.rewards.REGISTRY`)."""
    weight: float = 1.0
    """Multiplier in the total; 0 keeps it as a logged metric only."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments bound to the reward function."""
    timeout_s: TimeoutS = AUTO
    """Time budget of one call (all samples of the batch), in seconds; None: no budget (the
    reward then runs in the caller's thread, so a reward that hangs stalls training); "auto":
    `DEFAULT_TIMEOUT_S`, or no budget for a reward registered with `own_time_limit=True`."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise ValueError(f"unknown key {key!r} in a reward spec{did_you_mean(key, cls.model_fields)}")
        return data

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("weight must be finite")
        return v



@dataclass
class CrossCheck:
    """Run `checker` on a random `fraction` of the samples and compare it with `primary`."""

    primary: str
    """Name of the reward (in the set) whose scores are checked."""
    checker: str | Callable[..., list]
    """Registered reward name or a callable with the reward signature."""
    fraction: float = 0.1
    """Probability that a sample is checked."""
    dump_path: str | os.PathLike | None = None
    """JSON-lines file to which disagreeing samples are appended; None: not written."""
    checker_args: dict | None = None
    """Keyword arguments for the checker; None: the primary's args that the checker accepts."""
    tol: float = 1e-6
    """Scores further apart than this disagree."""
    seed: int = 0
    """Seed of the sampling of checked samples."""
    timeout_s: float | None | str = AUTO
    """Time budget of one checker call, in seconds; None: no budget; "auto": `DEFAULT_TIMEOUT_S`,
    or no budget for a checker registered with `own_time_limit=True` (e.g. math_accuracy_alt)."""

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"CrossCheck.fraction must be in [0, 1], got {self.fraction}")
        self.timeout_s = check_timeout(self.timeout_s)


@dataclass
class RewardOutput:
    total: list[float]
    per_fn: dict[str, list[float | None]]
    metrics: dict[str, float] = field(default_factory=dict)


def _explicit_params(fn) -> dict[str, inspect.Parameter]:
    try:
        sig = inspect.signature(fn, eval_str=True)
    except (TypeError, ValueError, NameError):
        sig = inspect.signature(fn)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p for p in sig.parameters.values() if p.kind in kinds and p.name not in ("prompts", "completions")}


def check_args(name: str, fn, args: dict) -> dict:
    """Every arg must be a named parameter of `fn` (so a typo is not swallowed by **columns) and
    fit its annotation when it has a simple one, and pass `fn.validate_args(name, args)` when the
    function has one (ValueError). Returns the validated args."""
    params = _explicit_params(fn)
    out = {}
    for key, val in args.items():
        if key not in params:
            raise ValueError(f"reward {name!r} has no argument {key!r}{did_you_mean(key, params)} "
                             f"(arguments: {', '.join(sorted(params)) or 'none'})")
        ann = params[key].annotation
        if ann is inspect.Parameter.empty or ann is Any or isinstance(ann, str):
            out[key] = val
            continue
        try:
            adapter = TypeAdapter(ann)
        except Exception:  # noqa: BLE001 - an annotation pydantic cannot read: not checked
            out[key] = val
            continue
        try:
            out[key] = adapter.validate_python(val)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"reward {name!r}: bad value {val!r} for argument {key!r}: "
                             f"{str(e).splitlines()[-1].strip()}") from None
    extra = getattr(fn, "validate_args", None)        # a reward's own check of its args (the judges')
    if extra is not None:
        extra(name, out)
    return out


class RewardSet:
    """The rewards of a run, built once from config: `RewardSet.from_specs(cfg.rewards)`."""

    def __init__(self, specs: list[RewardSpec], fns: list[Callable], crosscheck: CrossCheck | None = None,
                 checker_fn: Callable | None = None, checker_args: dict | None = None):
        # "auto" budgets are resolved here, against the functions (see `resolve_timeout`)
        specs = [s.model_copy(update={"timeout_s": resolve_timeout(s.timeout_s, f)}) for s, f in zip(specs, fns)]
        self.specs, self.fns = specs, fns
        self.checker_timeout_s = resolve_timeout(crosscheck.timeout_s, checker_fn) if crosscheck else None
        self.crosscheck, self._checker_fn, self._checker_args = crosscheck, checker_fn, checker_args or {}
        self._rng = random.Random(crosscheck.seed if crosscheck else 0)
        self._logged: set[str] = set()
        self.error_counts: dict[str, int] = {s.name: 0 for s in specs}
        self.calls = 0
        self._dump_lock = threading.Lock()

    @classmethod
    def from_specs(cls, specs, *, crosscheck: CrossCheck | dict | None = None) -> "RewardSet":
        # specs may also be the trainer's own config models: read them as plain dicts
        as_dict = lambda x: x.model_dump() if hasattr(x, "model_dump") else x  # noqa: E731
        parsed = [s if isinstance(s, RewardSpec) else RewardSpec.model_validate(as_dict(s)) for s in specs]
        if not parsed:
            raise ValueError("no rewards configured")
        names = [s.name for s in parsed]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"reward(s) listed twice: {sorted(dup)}")
        fns = [resolve(s.name) for s in parsed]
        parsed = [s.model_copy(update={"args": check_args(s.name, f, s.args)}) for s, f in zip(parsed, fns)]
        checker_fn, checker_args = None, None
        if crosscheck is not None and not isinstance(crosscheck, CrossCheck):
            crosscheck = as_dict(crosscheck)
        if isinstance(crosscheck, dict):
            unknown = set(crosscheck) - set(CrossCheck.__dataclass_fields__)
            if unknown:
                k = sorted(unknown)[0]
                raise ValueError(f"unknown key {k!r} in crosscheck{did_you_mean(k, CrossCheck.__dataclass_fields__)}")
            crosscheck = CrossCheck(**crosscheck)
        if crosscheck is not None:
            if crosscheck.primary not in names:
                raise ValueError(f"crosscheck.primary {crosscheck.primary!r} is not among the rewards "
                                 f"{names}{did_you_mean(crosscheck.primary, names)}")
            checker_fn = resolve(crosscheck.checker) if isinstance(crosscheck.checker, str) else crosscheck.checker
            if not callable(checker_fn):
                raise ValueError("crosscheck.checker must be a reward name or a callable")
            cname = crosscheck.checker if isinstance(crosscheck.checker, str) else "checker"
            if crosscheck.checker_args is not None:
                checker_args = check_args(cname, checker_fn, crosscheck.checker_args)
            else:
                accepted = _explicit_params(checker_fn)
                prim = parsed[names.index(crosscheck.primary)].args
                checker_args = {k: v for k, v in prim.items() if k in accepted}
        return cls(parsed, fns, crosscheck, checker_fn, checker_args)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    # ------------------------------------------------------------------ scoring

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> RewardOutput:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions (repeat each prompt per sample)")
        for k, v in columns.items():
            if len(v) != n:
                raise ValueError(f"column {k!r} has {len(v)} entries for {n} completions")
        self.calls += 1
        per_fn: dict[str, list[float | None]] = {}
        metrics: dict[str, float] = {}
        for spec, fn in zip(self.specs, self.fns):
            t0 = time.perf_counter()
            settings = getattr(fn, "settings", ())         # parameters no column may fill (the judges')
            cols = {k: v for k, v in columns.items() if k not in settings} if settings else columns
            vals = self._invoke(spec.name, fn, {**cols, **spec.args}, spec.timeout_s, prompts, completions)
            metrics[f"time/reward_{spec.name}"] = time.perf_counter() - t0
            failed = vals is None
            if failed:
                vals = [None] * n
                self.error_counts[spec.name] += 1
            per_fn[spec.name] = vals
            scored = [v for v in vals if v is not None]
            metrics[f"reward/{spec.name}/mean"] = sum(scored) / len(scored) if scored else float("nan")
            metrics[f"reward/{spec.name}/errors"] = float(n if failed else 0)
            metrics[f"reward/{spec.name}/none_frac"] = (n - len(scored)) / n if n else 0.0
        total = []
        for i in range(n):
            parts = [per_fn[s.name][i] for s in self.specs]
            total.append(float("nan") if any(p is None for p in parts)
                         else sum(s.weight * p for s, p in zip(self.specs, parts)))
        n_nan = sum(1 for t in total if math.isnan(t))
        metrics["reward/total_nan_frac"] = n_nan / n if n else 0.0
        if self.crosscheck is not None:
            metrics.update(self._cross_check(prompts, completions, columns, per_fn))
        return RewardOutput(total, per_fn, metrics)

    def diagnose(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> list[str | None]:
        """Why each completion fails the first reward, in words (its `diagnose`, see
        grpokit.rewards.registry), or None per completion where that reward has no diagnosis. A
        diagnosis that raises or returns the wrong shape is contained like a reward: logged once,
        None for the call."""
        spec, fn = self.specs[0], self.fns[0]
        diag = getattr(fn, "diagnose", None)
        n = len(completions)
        if diag is None or n == 0:
            return [None] * n
        settings = getattr(fn, "settings", ())
        cols = {k: v for k, v in columns.items() if k not in settings} if settings else columns
        try:
            out = list(diag(prompts, completions, **{**cols, **spec.args}))
            if len(out) != n:
                raise ValueError(f"returned {len(out)} diagnoses for {n} completions")
            return [o if isinstance(o, str) and o.strip() else None for o in out]
        except Exception:  # noqa: BLE001 - a diagnosis is optional: the note falls back to its generic text
            key = f"{spec.name}.diagnose"
            if key not in self._logged:
                self._logged.add(key)
                logger.error("the diagnosis of reward %r failed; rewritten notes use the generic text "
                             "(first failure):\n%s", spec.name, traceback.format_exc())
            return [None] * n

    def _invoke(self, name: str, fn, kwargs: dict, timeout_s: float | None, prompts, completions):
        """The validated scores, or None after a contained failure."""
        n = len(completions)
        box: dict = {}

        def target():
            try:
                box["v"] = fn(list(prompts), list(completions), **kwargs)
            except BaseException as e:  # noqa: BLE001 - sys.exit() in a reward must not end training
                box["e"] = e

        if timeout_s is None:
            target()
        else:
            t = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
            t.start()
            t.join(timeout_s)
            if t.is_alive():
                frame = sys._current_frames().get(t.ident)
                where = "".join(traceback.format_stack(frame)) if frame is not None else ""
                self._report(name, f"exceeded its time budget of {timeout_s:g} s; it was at:\n{where}")
                return None
        if "e" in box:
            e = box["e"]
            if isinstance(e, KeyboardInterrupt):  # the user's Ctrl-C (or a reward asking for one)
                raise e
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            if "signal only works in main thread" in text:
                text += ("(this reward sets signal handlers, e.g. math_verify's own timeouts; with a "
                         "time budget it runs in a thread: give it timeout_s: null, or turn its timeouts off)\n")
            self._report(name, text)
            return None
        try:
            return _validate(box.get("v"), n)
        except ValueError as e:
            self._report(name, str(e))
            return None

    def _report(self, name: str, text: str) -> None:
        if name not in self._logged:
            self._logged.add(name)
            logger.error("reward %r failed; its samples score None this call (first failure, "
                         "later ones are logged at DEBUG):\n%s", name, text)
        else:
            logger.debug("reward %r failed again:\n%s", name, text)

    # ------------------------------------------------------------------ cross-checking

    def _cross_check(self, prompts, completions, columns, per_fn) -> dict[str, float]:
        cc = self.crosscheck
        primary = per_fn[cc.primary]
        picked = [i for i in range(len(completions)) if self._rng.random() < cc.fraction]
        idx = [i for i in picked if primary[i] is not None]
        metrics = {"reward/checker_disagreement": 0.0, "reward/checker_checked": 0.0, "reward/checker/errors": 0.0}
        if not idx:
            return metrics
        sub_cols = {k: [v[i] for i in idx] for k, v in columns.items()}
        checked = self._invoke("checker", self._checker_fn, {**sub_cols, **self._checker_args}, self.checker_timeout_s,
                               [prompts[i] for i in idx], [completions[i] for i in idx])
        if checked is None:
            metrics["reward/checker/errors"] = float(len(idx))
            return metrics
        pairs = [(i, primary[i], c) for i, c in zip(idx, checked) if c is not None]
        bad = [(i, p, c) for i, p, c in pairs if abs(p - c) > cc.tol]
        metrics["reward/checker_checked"] = float(len(pairs))
        metrics["reward/checker_disagreement"] = len(bad) / len(pairs) if pairs else 0.0
        if bad and cc.dump_path is not None:
            self._dump(bad, prompts, completions, columns)
        return metrics

    def _dump(self, bad, prompts, completions, columns) -> None:
        cc = self.crosscheck
        checker = cc.checker if isinstance(cc.checker, str) else getattr(cc.checker, "__name__", repr(cc.checker))
        lines = []
        for i, p, c in bad:
            rec = {"call": self.calls, "index": i, "primary": cc.primary, "primary_score": p, "checker": checker,
                   "checker_score": c, "prompt": prompts[i], "completion": completions[i],
                   "columns": {k: v[i] for k, v in columns.items()}}
            lines.append(json.dumps(rec, default=repr, ensure_ascii=False))
        try:
            path = os.fspath(cc.dump_path)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with self._dump_lock, open(path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        except OSError as e:
            self._report("checker-dump", f"cannot write {cc.dump_path}: {e}")


def _validate(vals, n: int) -> list[float | None]:
    if isinstance(vals, (str, bytes)) or not hasattr(vals, "__len__"):
        raise ValueError(f"returned {type(vals).__name__}, not a list of scores")
    if len(vals) != n:
        raise ValueError(f"returned {len(vals)} scores for {n} completions")
    out: list[float | None] = []
    for v in vals:
        if v is None:
            out.append(None)
            continue
        if isinstance(v, (str, bytes)):
            raise ValueError(f"returned a non-number {v!r}")
        if not isinstance(v, numbers.Real):
            try:
                v = float(v)  # numpy / torch scalars
            except (TypeError, ValueError):
                raise ValueError(f"returned a non-number {v!r}") from None
        v = float(v)
        if math.isnan(v):
            out.append(None)
        elif math.isinf(v):
            raise ValueError(f"returned an infinite score {v}")
        else:
            out.append(v)
    return out
