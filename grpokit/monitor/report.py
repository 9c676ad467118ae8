"""A self-contained HTML report of one run directory.

``write_report(run_dir)`` reads what the trainer and the health monitor wrote (``metrics.jsonl``,
``alarms.jsonl``, ``guard.jsonl``, ``config.yaml``, ``samples/step_*.jsonl``) and writes
``RUN_DIR/report.html``. It leads with the GRPO health signals (``LEADING_SIGNALS``: policy loss,
KL to the reference, mean reward, response length, advantage std, token-level loss, held-out
pass@1), one plot each: the raw value faint, its centred moving average solid, the thresholds of
the health monitor's alarms that read it drawn as dashed lines with the alarm side shaded, and
the steps where an alarm fired marked; a signal the run did not log says so. Then the health
summary, the updates the non-finite guard skipped and the rollbacks with their causes, every other
logged metric plotted against the step (one small-multiples figure per metric namespace), the
metrics that never changed in one collapsed table instead of flat plots, samples from early,
middle and late training with their reward breakdown, and the config. Plots are PNGs made with
matplotlib's Agg canvas and embedded as base64; a long series is reduced to per-bucket minima and
maxima before plotting, so the page stays small. The page loads nothing and runs no script.

Missing files, empty files, NaN/inf values and malformed lines never stop the report: a malformed
line is skipped and listed under "Notes".

Run it by hand with ``python -m grpokit.monitor.report RUN_DIR``.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import html
import io
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from pydantic import ValidationError

from grpokit.monitor.health import ALARMS_FILE, RULES, Alarm, HealthConfig, summarize_alarms

REPORT_FILE = "report.html"
SAMPLES_PER_PHASE = 4
MAX_TEXT = 1500  # characters of a prompt or completion shown before truncation
MAX_LINE_NOTES = 5  # bad lines listed one by one per file; the rest are counted
MAX_GUARD_ROWS = 50  # guard events listed; the rest are counted
GUARD_FILE = "guard.jsonl"
# Namespaces shown first, in the order of the step's data flow; others follow alphabetically.
NAMESPACE_ORDER = (
    "reward", "eval", "kl", "loss", "advantage", "group", "completion", "policy", "optim",
    "guard", "ref", "throughput", "time", "memory",
)
_NOT_SIGNALS = frozenset({"step", "time"})
# The GRPO health signals the report leads with, in this order: (metric, what it is).
LEADING_SIGNALS: tuple[tuple[str, str], ...] = (
    ("loss/policy", "policy loss"),
    ("kl/ref", "KL to the reference"),
    ("reward/mean", "mean reward"),
    ("completion/length_mean", "response length (tokens)"),
    ("advantage/std", "advantage std"),
    ("loss/token_mean", "token-level loss"),
    ("eval/pass@1", "held-out pass@1 (greedy)"),
)
MAX_PLOT_POINTS = 600  # points per plotted line; a longer series keeps each bucket's min and max


@dataclasses.dataclass
class RunData:
    """Everything the report shows, as read from a run directory."""

    metrics: list[dict[str, Any]]  # one row per step, sorted by step
    alarms: list[Alarm]
    guard_events: list[dict[str, Any]]  # guard.jsonl: skipped updates and rollbacks, by step
    samples: list[tuple[str, int, list[dict[str, Any]]]]  # (phase, step, rows): early/middle/late
    n_sample_files: int
    config_text: str | None
    notes: list[str]  # problems met while reading, for the reader of the report
    config: dict[str, Any] | None = None  # config.yaml parsed; None when absent or not a mapping


def read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The JSON-object lines of ``path``; a malformed line is skipped and noted."""
    rows: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        notes.append(f"{_rel(path)}: could not be read ({e.strerror or e}).")
        return rows
    bad = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)  # accepts NaN / Infinity as Python's json writes them
            problem = None if isinstance(row, dict) else "not a JSON object"
        except ValueError:
            problem = "malformed JSON"
        if problem is None:
            rows.append(row)
            continue
        bad += 1
        if bad <= MAX_LINE_NOTES:
            notes.append(f"{_rel(path)} line {lineno}: {problem}, skipped.")
    if bad > MAX_LINE_NOTES:
        notes.append(f"{_rel(path)}: {bad - MAX_LINE_NOTES} more bad line(s) skipped.")
    return rows


def _rel(path: Path) -> str:
    return f"{path.parent.name}/{path.name}" if path.parent.name == "samples" else path.name


def _as_step(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v)


def load_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Read a run directory, tolerating anything missing or malformed."""
    run_dir = Path(run_dir)
    notes: list[str] = []
    if not run_dir.is_dir():
        notes.append(f"Run directory {run_dir} does not exist.")
    metrics = _load_metrics(run_dir / "metrics.jsonl", notes)
    alarms = _load_alarms(run_dir / ALARMS_FILE, notes)
    guard_path = run_dir / GUARD_FILE
    guard_events = read_jsonl(guard_path, notes) if guard_path.is_file() else []
    samples_dir = run_dir / "samples"
    paths = sorted(samples_dir.glob("*.jsonl"), key=_file_step) if samples_dir.is_dir() else []
    samples = []
    for phase, path in _phases(paths):  # only these files are read: a long run has many
        rows = read_jsonl(path, notes)
        step = _file_step(path)[0]
        if step == math.inf:
            step = _as_step(rows[0].get("step")) if rows else None
        samples.append((phase, -1 if step is None else int(step), rows))
    config_text, config = _load_config(run_dir / "config.yaml", notes)
    return RunData(metrics, alarms, guard_events, samples, len(paths), config_text, notes, config)


def _load_metrics(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """One row per step, sorted by step; when a resumed run re-logged a step, its later row."""
    if not path.is_file():
        notes.append("metrics.jsonl is missing.")
        return []
    by_step: dict[int, dict[str, Any]] = {}
    no_step = dup = 0
    for row in read_jsonl(path, notes):
        step = _as_step(row.get("step"))
        if step is None:
            no_step += 1
            continue
        dup += step in by_step
        by_step[step] = row
    if no_step:
        notes.append(f"metrics.jsonl: {no_step} row(s) without a numeric 'step' skipped.")
    if dup:
        notes.append(f"metrics.jsonl: {dup} step(s) logged twice (a resumed run?); "
                     "the later row is shown.")
    return [by_step[s] for s in sorted(by_step)]


def _load_alarms(path: Path, notes: list[str]) -> list[Alarm]:
    """Alarms sorted by step, one per (name, step): a resumed run may log a step's alarm twice."""
    by_key: dict[tuple[str, int], Alarm] = {}
    if path.is_file():
        for row in read_jsonl(path, notes):
            try:
                alarm = Alarm.from_dict(row)
            except (KeyError, TypeError, ValueError):
                notes.append(f"{ALARMS_FILE}: a row without a usable name or step was skipped.")
                continue
            by_key[(alarm.name, alarm.step)] = alarm
    return sorted(by_key.values(), key=lambda a: a.step)


def _load_config(path: Path, notes: list[str]) -> tuple[str | None, dict[str, Any] | None]:
    """(text, mapping): the config re-dumped as block YAML (the raw text if it does not parse, None
    if absent) and the parsed mapping (None unless the file is a YAML mapping)."""
    if not path.is_file():
        return None, None
    raw = path.read_text(encoding="utf-8", errors="replace")
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError:
        notes.append("config.yaml is not valid YAML; it is shown as written.")
        return raw, None
    if parsed is None:
        return "", None
    text = yaml.safe_dump(parsed, sort_keys=False, allow_unicode=True, default_flow_style=False,
                          width=100)
    return text, parsed if isinstance(parsed, dict) else None


def _file_step(path: Path) -> tuple[float, str]:
    """Sort key of a samples file: the step in its name (step_000010.jsonl -> 10), then the name."""
    m = re.search(r"(\d+)", path.stem)
    return (int(m.group(1)) if m else math.inf, path.name)


def _phases(items: Sequence[Any]) -> list[tuple[str, Any]]:
    """The first, middle and last of ``items``, named early / middle / late."""
    n = len(items)
    if n == 0:
        return []
    if n == 1:
        return [("only", items[0])]
    if n == 2:
        return [("early", items[0]), ("late", items[1])]
    return [("early", items[0]), ("middle", items[n // 2]), ("late", items[-1])]


# --------------------------------------------------------------------------------------------
# Plots


def _namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "other"


def group_signals(metrics: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Numeric metric names by namespace, namespaces in NAMESPACE_ORDER then alphabetical."""
    keys: set[str] = set()
    for row in metrics:
        for k, v in row.items():
            if k not in _NOT_SIGNALS and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.add(k)
    groups: dict[str, list[str]] = {}
    for k in sorted(keys, key=lambda k: (k.count("/"), k)):  # reward/mean before reward/<fn>/mean
        groups.setdefault(_namespace(k), []).append(k)
    rank = {ns: i for i, ns in enumerate(NAMESPACE_ORDER)}
    return {ns: groups[ns] for ns in sorted(groups, key=lambda ns: (rank.get(ns, len(rank)), ns))}


def _alarm_marks(alarms: Sequence[Alarm]) -> dict[str, list[tuple[str, str, list[tuple[int, int]]]]]:
    """metric key -> [(alarm name, severity, [(first, last) step runs])] for the rules' metrics."""
    steps: dict[str, set[int]] = {}
    severity: dict[str, str] = {}
    for a in alarms:
        steps.setdefault(a.name, set()).add(a.step)
        if a.severity == "stop" or a.name not in severity:
            severity[a.name] = a.severity
    marks: dict[str, list[tuple[str, str, list[tuple[int, int]]]]] = {}
    for name, s in steps.items():
        runs: list[tuple[int, int]] = []
        for step in sorted(s):  # consecutive firings collapse into one shaded span
            if runs and step - runs[-1][1] <= 1:
                runs[-1] = (runs[-1][0], step)
            else:
                runs.append((step, step))
        for key in RULES[name].keys if name in RULES else ():
            marks.setdefault(key, []).append((name, severity[name], runs))
    return marks


# ---- smoothing, downsampling, constant metrics


def smoothing_window(n: int) -> int:
    """Width (odd, in logged values) of the centred moving average drawn over a series of ``n``
    values: about n / 25, between 5 and 51; 1 (no smoothing) below 8 values."""
    if n < 8:
        return 1
    return int(min(51, max(5, 2 * round(n / 50) + 1)))


def centred_average(y: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average of ``y`` [n] over ``window`` (odd) values: out[i] is the mean of
    y[i - h .. i + h], h = window // 2, the window cut at both ends of the series."""
    y = np.asarray(y, dtype=float)
    n = y.size
    h = max(0, window // 2)
    m = float(y.mean()) if n else 0.0  # prefix sums of y - m keep their precision on a large offset
    c = np.concatenate([[0.0], np.cumsum(y - m)])  # [n + 1]
    i = np.arange(n)
    lo, hi = np.maximum(0, i - h), np.minimum(n, i + h + 1)
    return (c[hi] - c[lo]) / (hi - lo) + m


def downsample(x: np.ndarray, y: np.ndarray, max_points: int = MAX_PLOT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points of the line (x, y): unchanged when short enough, else the first
    and last point and, per bucket of consecutive points, its lowest and highest (in step order),
    so spikes survive."""
    n = x.size
    if n <= max_points:
        return x, y
    n_buckets = max(1, (max_points - 2) // 2)
    edges = np.linspace(0, n, n_buckets + 1).astype(int)  # [n_buckets + 1] bucket bounds
    keep = {0, n - 1}
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            keep.add(a + int(np.argmin(y[a:b])))
            keep.add(a + int(np.argmax(y[a:b])))
    idx = np.array(sorted(keep))
    return x[idx], y[idx]


def constant_metrics(
    metrics: Sequence[Mapping[str, Any]], keys: Sequence[str]
) -> dict[str, tuple[float, int]]:
    """key -> (value, steps logged) for each of ``keys`` whose every logged value is the same
    (NaN counts as equal to NaN, so an all-NaN metric is constant)."""
    out: dict[str, tuple[float, int]] = {}
    for key in keys:
        seen: set[Any] = set()
        n = 0
        first = math.nan
        for row in metrics:
            v = row.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = float(v)
                seen.add("nan" if math.isnan(v) else v)  # 0.0 and -0.0 are one value
                if len(seen) > 1:
                    break
                first = v if n == 0 else first
                n += 1
        if len(seen) == 1:
            out[key] = (first, n)
    return out


# ---- alarm thresholds


def _mapping(d: Any, *keys: str) -> dict[str, Any]:
    """d[k0][k1]... when every level is a mapping, else {}."""
    for k in keys:
        d = d.get(k) if isinstance(d, Mapping) else None
    return dict(d) if isinstance(d, Mapping) else {}


def kl_target_high(config: Mapping[str, Any]) -> float | None:
    """The value the trainer gives `health.kl_climbing.kl_high` when the config leaves it unset
    (``grpokit.train.kl_target_high``), worked out from a config.yaml mapping without importing
    the trainer: the adaptive controller's upper target, Ziegler's target (also under a warm-up or
    schedule wrapper), None for the others, with beta = 0, or when the config does not validate."""
    from grpokit.algo.control import AdaptiveKL, ZieglerKL, build_controller
    from grpokit.config import ConfigError, config_from_dict

    try:
        cfg = config_from_dict(dict(config))
        k = cfg.algorithm.kl
        if k.beta == 0:
            return None
        args = dict(k.controller_args)
        if k.controller == "adaptive":
            args = {"low": k.target_low, "high": k.target_high, "factor": k.adapt_factor, **args}
        if k.controller in ("warmup", "schedule"):
            args.setdefault("inner", {"kind": "fixed", "beta": k.beta})
            if k.controller == "schedule":
                args.setdefault("total_steps", cfg.train.steps)
            ctl = build_controller(k.controller, **args)
        else:
            ctl = build_controller(k.controller, beta=k.beta, **args)
    except (ConfigError, ValueError, TypeError):
        return None
    while hasattr(ctl, "inner"):
        ctl = ctl.inner
    if isinstance(ctl, AdaptiveKL):
        return ctl.high
    if isinstance(ctl, ZieglerKL):
        return ctl.target
    return None


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The health monitor's settings as far as the run directory tells, and where they came from."""

    health: HealthConfig
    origin: str  # for the reader: "config.yaml", or why the defaults are used
    filled: dict[str, str]  # "rule.field" -> where the trainer took that value from instead


def health_thresholds(config: Mapping[str, Any] | None) -> Thresholds:
    """The thresholds the run's health monitor used: ``health:`` of config.yaml, with the two fields
    the trainer fills in from the rest of the config when they are not set (``build_health``):
    `kl_climbing.kl_high` (the KL controller's upper target) and `ref_drift.tolerance`
    (`guard.ref_tolerance`). config.yaml holds every field, set or not, so a null `kl_high` and a
    `ref_drift.tolerance` at its default count as not set. Defaults without config.yaml or when its
    ``health:`` does not validate."""
    if config is None:
        return Thresholds(HealthConfig(), "defaults (no readable config.yaml)", {})
    try:
        health = HealthConfig.model_validate(_mapping(config, "health"))
    except ValidationError as e:
        first = e.errors()[0].get("msg", "invalid") if e.errors() else "invalid"
        return Thresholds(HealthConfig(), f"defaults (config.yaml's health section: {first})", {})
    filled: dict[str, str] = {}
    if health.kl_climbing.kl_high is None:
        high = kl_target_high(config)
        if high is not None and 0 < high < math.inf:
            health.kl_climbing.kl_high = high
            filled["kl_climbing.kl_high"] = "the KL controller's upper target (algorithm.kl)"
            unit = _mapping(_mapping(config, "algorithm"), "kl").get("target_unit", "sequence")
            if unit in ("token", "sequence"):
                health.kl_climbing.unit = unit
    tol = _mapping(config, "guard").get("ref_tolerance")
    default_tol = type(health.ref_drift).model_fields["tolerance"].default
    if (health.ref_drift.tolerance == default_tol and isinstance(tol, (int, float))
            and not isinstance(tol, bool) and tol >= 0 and tol != default_tol):
        health.ref_drift.tolerance = float(tol)
        filled["ref_drift.tolerance"] = "guard.ref_tolerance"
    return Thresholds(health, "config.yaml", filled)


@dataclasses.dataclass(frozen=True)
class Band:
    """An alarm threshold drawn on one metric's plot: a dashed line at ``value`` and, when ``side``
    is set, the side of it where the rule fires shaded (None: a dotted guide line only)."""

    key: str  # the metric plotted
    rule: str  # the health rule it belongs to
    field: str  # the HealthConfig field it comes from, "rule.field"
    label: str  # what the line means, in words
    value: float | np.ndarray  # a number, or one value per step of the run (NaN where none yet)
    side: Literal["above", "below"] | None


def length_alarm_level(lengths: np.ndarray, p: Any) -> np.ndarray:
    """Per value of ``lengths`` (finite, in step order): the level the median of the last
    ``p.recent`` values must reach for `length_explosion` to fire at that point,
    max(factor · baseline, baseline + min_increase), baseline = median of the up-to
    ``baseline_window`` values before those; NaN while fewer than recent + min_baseline values."""
    x = np.asarray(lengths, dtype=float)
    out = np.full(x.size, np.nan)
    for i in range(p.recent + p.min_baseline - 1, x.size):
        base = x[max(0, i + 1 - p.recent - p.baseline_window): i + 1 - p.recent]
        b = float(np.median(base))
        if b > 0:
            out[i] = max(p.factor * b, b + p.min_increase)
    return out


def alarm_bands(
    health: HealthConfig, steps: np.ndarray, columns: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> dict[str, list[Band]]:
    """metric key -> the thresholds of the enabled health rules that read it, for drawing."""
    bands: dict[str, list[Band]] = {}

    def add(band: Band) -> None:
        if band.key in columns:
            bands.setdefault(band.key, []).append(band)

    on = {name: getattr(health, name).action != "off" for name in RULES if hasattr(health, name)}
    kl = health.kl_climbing
    if on.get("kl_climbing"):
        if kl.kl_high is not None:
            add(Band("kl/ref_seq" if kl.unit == "sequence" else "kl/ref", "kl_climbing", "kl_climbing.kl_high",
                     f"kl_high {kl.kl_high:.3g}: alarm after {kl.high_steps} steps above", kl.kl_high, "above"))
        add(Band("kl/ref", "kl_climbing", "kl_climbing.min_kl",
                 f"min_kl {kl.min_kl:.3g}: a rise below it is ignored", kl.min_kl, None))
    le = health.length_explosion
    if on.get("length_explosion") and "completion/length_mean" in columns:
        raw = columns["completion/length_mean"][0]
        finite = np.isfinite(raw)
        level = np.full(steps.size, np.nan)
        level[finite] = length_alarm_level(raw[finite], le)
        add(Band("completion/length_mean", "length_explosion", "length_explosion.factor",
                 f"alarm when the median of the last {le.recent} reaches {le.factor:g}x the median "
                 f"of the {le.baseline_window} before (and +{le.min_increase:g} tokens)", level, "above"))
    ns = health.no_signal
    if on.get("no_signal"):
        add(Band("advantage/std", "no_signal", "no_signal.adv_std_eps",
                 f"adv_std_eps {ns.adv_std_eps:.3g}: alarm when the median of {ns.window} is at or below",
                 ns.adv_std_eps, "below"))
        add(Band("group/frac_zero_std", "no_signal", "no_signal.max_frac_zero_std",
                 f"max_frac_zero_std {ns.max_frac_zero_std:.3g}", ns.max_frac_zero_std, "above"))
    rh = health.reward_hacking
    if on.get("reward_hacking"):
        add(Band("reward/checker_disagreement", "reward_hacking", "reward_hacking.max_disagreement",
                 f"max_disagreement {rh.max_disagreement:.3g}", rh.max_disagreement, "above"))
    ec = health.entropy_collapse
    if on.get("entropy_collapse"):
        add(Band("policy/entropy", "entropy_collapse", "entropy_collapse.floor",
                 f"floor {ec.floor:.3g}", ec.floor, "below"))
        if "policy/entropy" in columns:
            ent = columns["policy/entropy"][0]
            ent = ent[np.isfinite(ent)]
            if ent.size >= ec.early_window + ec.recent:
                rel = ec.min_fraction * float(np.median(ent[: ec.early_window]))
                add(Band("policy/entropy", "entropy_collapse", "entropy_collapse.min_fraction",
                         f"{ec.min_fraction:g}x the early median", rel, "below"))
    rd = health.ref_drift
    if on.get("ref_drift"):
        add(Band("ref/integrity_drift", "ref_drift", "ref_drift.tolerance",
                 f"tolerance {rd.tolerance:.3g}", rd.tolerance, "above"))
    return bands


# ---- figures

_RAW = "#1f77b4"
_BAND = "#d62728"


def _draw_marks(ax: Any, marks: Sequence[tuple[str, str, list[tuple[int, int]]]]) -> list[str]:
    names = []
    for name, severity, runs in marks:
        color = "#d62728" if severity == "stop" else "#ff7f0e"
        names.append(name)
        for first, last in runs:
            ax.axvline(first, color=color, linewidth=1.0, alpha=0.9)
            if last > first:
                ax.axvspan(first, last, color=color, alpha=0.15, linewidth=0)
    return names


def _draw_bands(ax: Any, bands: Sequence[Band], steps: np.ndarray, x_finite: np.ndarray,
                y_finite: np.ndarray) -> None:
    """Dashed threshold lines with their alarm side shaded; the y range covers data and lines."""
    if not bands:
        return
    lo = [float(y_finite.min())] if y_finite.size else []
    hi = [float(y_finite.max())] if y_finite.size else []
    for b in bands:
        v = np.asarray(b.value, dtype=float)
        if v.ndim == 0 and math.isfinite(float(v)):
            lo.append(float(v))
            hi.append(float(v))
        elif v.ndim == 1 and np.isfinite(v).any():
            lo.append(float(np.nanmin(v)))
            hi.append(float(np.nanmax(v)))
    if not lo:
        return
    y0, y1 = min(lo), max(hi)
    pad = 0.06 * (y1 - y0) if y1 > y0 else max(abs(y0) * 0.1, 1e-3)
    y0, y1 = y0 - pad, y1 + pad
    ax.set_ylim(y0, y1)
    for b in bands:
        style = dict(color=_BAND if b.side else "#777777", linewidth=1.0,
                     linestyle="--" if b.side else ":", zorder=1)
        v = np.asarray(b.value, dtype=float)
        if v.ndim == 0:
            ax.axhline(float(v), **style)
            if b.side == "above":
                ax.axhspan(float(v), y1, color=_BAND, alpha=0.07, linewidth=0, zorder=0)
            elif b.side == "below":
                ax.axhspan(y0, float(v), color=_BAND, alpha=0.07, linewidth=0, zorder=0)
        else:
            ok = np.isfinite(v)
            xs, vs = downsample(steps[ok], v[ok])
            ax.plot(xs, vs, **style)
            if b.side == "above":
                ax.fill_between(xs, vs, y1, color=_BAND, alpha=0.07, linewidth=0, zorder=0)
            elif b.side == "below":
                ax.fill_between(xs, y0, vs, color=_BAND, alpha=0.07, linewidth=0, zorder=0)


def _draw_nonfinite(ax: Any, steps: np.ndarray, bad: np.ndarray) -> None:
    if bad.any():  # non-finite values: red crosses along the bottom edge
        ax.plot(steps[bad], np.full(bad.sum(), 0.03), "x", color="red", markersize=5,
                transform=ax.get_xaxis_transform(), clip_on=False)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def signal_lines(
    steps: np.ndarray, raw: np.ndarray
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None, int]:
    """The lines of one leading signal, before downsampling: (raw, smoothed, window). raw is
    (steps, values) at the steps with a finite value; smoothed is their centred average over
    ``smoothing_window`` values at the same steps, None when the window is 1."""
    finite = np.isfinite(raw)
    x, y = steps[finite], raw[finite]
    window = smoothing_window(y.size)
    return (x, y), ((x, centred_average(y, window)) if window > 1 else None), window


def plot_signal(
    steps: np.ndarray,
    column: tuple[np.ndarray, np.ndarray],
    marks: Sequence[tuple[str, str, list[tuple[int, int]]]],
    bands: Sequence[Band],
) -> bytes:
    """PNG bytes of one leading signal: raw values faint, their centred moving average over
    ``smoothing_window`` logged values solid, alarm thresholds and alarm steps drawn."""
    raw, logged = column  # [n_steps] values (NaN unless finite), [n_steps] was logged
    fig = Figure(figsize=(3.4, 2.3), dpi=100)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.17, right=0.95, top=0.91, bottom=0.13)
    ax = fig.add_subplot(1, 1, 1)
    finite = np.isfinite(raw)
    (x, y), smooth, _ = signal_lines(steps, raw)
    xr, yr = downsample(x, y)
    ax.plot(xr, yr, "-", color=_RAW, linewidth=0.8, alpha=0.35 if smooth is not None else 1.0,
            marker="o" if y.size <= 30 else None, markersize=2.5, zorder=2)
    if smooth is not None:
        xs, ys = downsample(*smooth)
        ax.plot(xs, ys, "-", color=_RAW, linewidth=1.8, zorder=3)
    _draw_nonfinite(ax, steps, logged & ~finite)
    _draw_marks(ax, marks)
    _draw_bands(ax, bands, steps, x, y)
    if steps.size > 1 and steps[-1] > steps[0]:
        ax.set_xlim(steps[0], steps[-1])
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3, linewidth=0.5)
    return _png(fig)


def plot_namespace(
    keys: Sequence[str],
    steps: np.ndarray,
    columns: Mapping[str, tuple[np.ndarray, np.ndarray]],
    marks: Mapping[str, list[tuple[str, str, list[tuple[int, int]]]]],
    bands: Mapping[str, Sequence[Band]] | None = None,
) -> bytes:
    """PNG bytes of one small-multiples figure: one panel per metric in ``keys``."""
    ncols = min(4, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(3.3 * ncols, 2.4 * nrows), dpi=80)
    FigureCanvasAgg(fig)
    height = 2.4 * nrows  # inches; margins below are fixed in inches so every figure matches
    fig.subplots_adjust(left=0.55 / (3.3 * ncols), right=1 - 0.1 / (3.3 * ncols),
                        top=1 - 0.5 / height, bottom=0.3 / height, wspace=0.35, hspace=0.7)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        raw, logged = columns[key]  # [n_steps] values (NaN unless finite), [n_steps] was logged
        finite = np.isfinite(raw)
        x, y = steps[finite], raw[finite]
        sparse = finite.sum() <= 30 or finite.sum() < 0.5 * len(steps)
        xd, yd = downsample(x, y)
        ax.plot(xd, yd, "-", color=_RAW, linewidth=1.0, marker="o" if sparse else None, markersize=3)
        bad = logged & ~finite
        _draw_nonfinite(ax, steps, bad)
        title = key if not y.size else f"{key} (last {y[-1]:.4g})"
        if bad.any():
            title += f"\n{int(bad.sum())} non-finite"
        names = _draw_marks(ax, marks.get(key, ()))
        _draw_bands(ax, (bands or {}).get(key, ()), steps, x, y)
        if names:
            title += "\nalarm: " + ", ".join(names)
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3, linewidth=0.5)
    return _png(fig)


def _columns(
    metrics: Sequence[Mapping[str, Any]], keys: Sequence[str]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """key -> (values [n_steps], NaN unless finite; logged [n_steps], a number was written)."""
    cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    n = len(metrics)
    for key in keys:
        vals = np.full(n, np.nan)
        logged = np.zeros(n, dtype=bool)
        for i, row in enumerate(metrics):
            v = row.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals[i] = v
                logged[i] = True
        cols[key] = (np.where(np.isfinite(vals), vals, np.nan), logged)
    return cols


# --------------------------------------------------------------------------------------------
# HTML


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _text_cell(text: Any) -> str:
    s = "" if text is None else str(text)
    more = ""
    if len(s) > MAX_TEXT:
        more = f'<span class="muted"> … ({len(s) - MAX_TEXT} more characters)</span>'
        s = s[:MAX_TEXT]
    return f"<pre>{_e(s)}</pre>{more}"


def _pick(rows: Sequence[Mapping[str, Any]], k: int) -> list[Mapping[str, Any]]:
    """Up to k rows spread over the reward range, highest reward first."""
    def key(r: Mapping[str, Any]) -> float:
        v = r.get("reward")
        return v if isinstance(v, (int, float)) and math.isfinite(v) else -math.inf

    ordered = sorted(rows, key=key, reverse=True)
    if len(ordered) <= k:
        return ordered
    idx = sorted({round(i) for i in np.linspace(0, len(ordered) - 1, k)})
    return [ordered[i] for i in idx]


def _breakdown(rewards: Any) -> str:
    if isinstance(rewards, Mapping):
        items = "".join(
            f"<li>{_e(k)}: {_e(_fmt(v)) if v is not None else '<span class=muted>none (error?)</span>'}</li>"
            for k, v in rewards.items()
        )
        return f"<ul>{items}</ul>" if items else ""
    return _e(rewards) if rewards is not None else ""


def _samples_html(phases: Sequence[tuple[str, int, list[dict[str, Any]]]], n_files: int) -> str:
    if not phases:
        return "<p>No samples were recorded (no samples/*.jsonl).</p>"
    head = ("<tr><th>phase / step</th><th>prompt</th><th>completion</th><th>answer</th>"
            "<th>reward</th><th>breakdown</th><th>advantage</th><th>length</th><th>finish</th></tr>")
    body = []
    for phase, step, rows in phases:
        for r in _pick(rows, SAMPLES_PER_PHASE):
            finish = r.get("finish_reason")
            body.append(
                "<tr>"
                f"<td>{_e(phase)}<br>step {_e(r.get('step', step))}</td>"
                f"<td>{_text_cell(r.get('prompt'))}</td>"
                f"<td>{_text_cell(r.get('completion'))}</td>"
                f"<td>{_text_cell(r['answer']) if 'answer' in r else '<span class=muted>—</span>'}</td>"
                f"<td>{_e(_fmt(r.get('reward')))}</td>"
                f"<td>{_breakdown(r.get('rewards'))}</td>"
                f"<td>{_e(_fmt(r.get('advantage')))}</td>"
                f"<td>{_e(_fmt(r.get('length')))}</td>"
                f"<td{' class=warn' if finish == 'length' else ''}>{_e(_fmt(finish))}</td>"
                "</tr>"
            )
    return (f"<p>{n_files} sample file(s); up to {SAMPLES_PER_PHASE} completions per phase, spread "
            f"over the reward range.</p><table class=samples>{head}{''.join(body)}</table>")


def _health_html(alarms: Sequence[Alarm], n_steps: int) -> str:
    """The plain-words summary: its first line, then one list item per alarm name."""
    lines = summarize_alarms(alarms, n_steps=n_steps if n_steps else None).splitlines()
    items = "".join(f"<li>{_e(line.removeprefix('- '))}</li>" for line in lines[1:])
    body = f"<p>{_e(lines[0])}</p>" + (f"<ul>{items}</ul>" if items else "")
    return f'<div class="health {"bad" if items else "ok"}">{body}</div>'


def _guard_html(events: Sequence[Mapping[str, Any]]) -> str:
    """The non-finite guard's events: one table row per skipped update or rollback, with its cause."""
    if not events:
        return "<p>The non-finite guard skipped no update.</p>"
    skips = sum(e.get("event") == "skip" for e in events)
    rollbacks = sum(e.get("event") == "rollback" for e in events)
    rows = []
    for e in events[:MAX_GUARD_ROWS]:
        kind = e.get("event")
        if kind == "rollback":
            what = f"rolled back to {e.get('to', '?')}, learning rate x{_fmt(e.get('lr_factor'))}"
        elif "updates" in e and e.get("updates_skipped") != e.get("updates"):
            what = f"{_fmt(e.get('updates_skipped'))} of {_fmt(e.get('updates'))} mini-batch updates skipped"
        else:
            what = "update skipped"
        rows.append(f"<tr><td>{_e(_fmt(e.get('step')))}</td><td{' class=stop' if kind == 'rollback' else ''}>"
                    f"{_e(what)}</td><td>{_e(e.get('cause', ''))}</td></tr>")
    more = (f"<p class=muted>{len(events) - MAX_GUARD_ROWS} more event(s) in {GUARD_FILE}.</p>"
            if len(events) > MAX_GUARD_ROWS else "")
    return (f"<p>{skips} step(s) with skipped updates, {rollbacks} rollback(s) ({GUARD_FILE}):</p>"
            f"<table class=guard><tr><th>step</th><th>what</th><th>cause</th></tr>{''.join(rows)}</table>{more}")


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}h3{margin-bottom:4px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f3f3f3}pre{white-space:pre-wrap;word-break:break-word;margin:0;font-size:12px}
table.samples td{max-width:380px}ul{margin:0;padding-left:16px}
.muted{color:#888}.warn{color:#b35900}.stop{color:#c00;font-weight:bold}
.health{padding:8px 12px;border-radius:4px}.health li{margin:6px 0}.health.ok{background:#eaf7ea}.health.bad{background:#fff3e0}
img{max-width:100%;display:block}pre.config{background:#f7f7f7;padding:8px;border:1px solid #ddd}
.signals{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:14px 18px;margin:10px 0}
figure.signal{margin:0}figure.signal img{width:100%;height:auto}
figure.signal figcaption{font-size:12px;line-height:1.35;margin-top:2px}figure.signal figcaption b{font-size:13px}
.nolog{aspect-ratio:340/230;display:flex;align-items:center;justify-content:center;flex-direction:column;
background:#f6f6f6;border:1px dashed #bbb;color:#777;font-size:15px;text-align:center}
.nolog small{font-size:12px;margin-top:4px}
.lede{font-size:13px;color:#444;max-width:1100px}ul.bands{font-size:13px;color:#444}ul.bands li{margin:2px 0}
details.constant{margin:8px 0 16px}details.constant summary{cursor:pointer;font-weight:600}
td.num{font-family:ui-monospace,Menlo,Consolas,monospace}
"""


def _signal_html(key: str, label: str, steps: np.ndarray | None,
                 columns: Mapping[str, tuple[np.ndarray, np.ndarray]],
                 marks: Mapping[str, list[tuple[str, str, list[tuple[int, int]]]]],
                 bands: Mapping[str, list[Band]]) -> str:
    """One leading signal: its plot and caption, or a 'not logged' box."""
    head = f"<b>{_e(label)}</b> <code>{_e(key)}</code>"
    col = columns.get(key)
    if steps is None or col is None or not col[1].any():
        hint = ("<small>no held-out set (data.eval_path) or no evaluation step</small>"
                if key.startswith("eval/") else "")
        return (f'<figure class="signal missing" data-metric="{_e(key)}"><div class=nolog>'
                f"not logged{hint}</div><figcaption>{head}<br><span class=muted>not logged in this "
                "run</span></figcaption></figure>")
    raw, logged = col
    y = raw[np.isfinite(raw)]
    facts = []
    if y.size:
        facts.append(f"last {y[-1]:.4g}")
        w = smoothing_window(y.size)
        facts.append(f"solid: centred average of {w} values" if w > 1
                     else f"{y.size} value{'s' if y.size != 1 else ''}, too few to smooth")
    bad = int((logged & ~np.isfinite(raw)).sum())
    if bad:
        facts.append(f"<span class=stop>{bad} non-finite</span>")
    lines = [head, " · ".join(facts)]
    my_bands = bands.get(key, [])
    if my_bands:
        lines.append("<span class=muted>" + "; ".join(
            f"{'dashed' if b.side else 'dotted'}: {_e(b.label)}" for b in my_bands) + "</span>")
    names = [name for name, _, _ in marks.get(key, ())]
    if names:
        sev = "stop" if any(s == "stop" for _, s, _ in marks.get(key, ())) else "warn"
        lines.append(f"<span class={sev}>alarm: {_e(', '.join(names))}</span>")
    png = base64.b64encode(plot_signal(steps, col, marks.get(key, ()), my_bands)).decode("ascii")
    return (f'<figure class=signal data-metric="{_e(key)}"><img alt="{_e(key)}" '
            f'src="data:image/png;base64,{png}"><figcaption>{"<br>".join(lines)}</figcaption></figure>')


def _bands_html(th: Thresholds, bands: Mapping[str, list[Band]]) -> str:
    """Where the drawn thresholds come from, one line per threshold on a leading signal."""
    items = []
    for key, _ in LEADING_SIGNALS:
        for b in bands.get(key, ()):
            where = th.filled.get(b.field)
            src = f"health.{b.field}" + (f" not set: {where}" if where else "")
            items.append(f"<li><code>{_e(key)}</code> ({_e(b.rule)}): {_e(b.label)} "
                         f"<span class=muted>— {_e(src)}</span></li>")
    off = [name for name in ("kl_climbing", "length_explosion", "no_signal")
           if getattr(th.health, name).action == "off"]
    if off:
        items.append(f"<li>{_e(', '.join(off))}: off in this run, no threshold drawn</li>")
    if ("kl/ref" in bands and th.health.kl_climbing.action != "off"
            and th.health.kl_climbing.kl_high is None):
        items.append("<li><code>kl/ref</code>: no kl_high (fixed KL coefficient, or beta = 0): "
                     "only the trend test can fire</li>")
    if not items:
        return ""
    return (f"<p class=lede>Alarm thresholds drawn (the run's health config: {_e(th.origin)}):</p>"
            f"<ul class=bands>{''.join(items)}</ul>")


def _constant_html(const: Mapping[str, tuple[float, int]], n_steps: int) -> str:
    if not const:
        return ""
    rows = "".join(
        f"<tr><td><code>{_e(k)}</code></td><td class=num>{_e(_fmt_value(v))}</td>"
        f"<td>{n if n != n_steps else 'every step'}</td></tr>"
        for k, (v, n) in const.items()
    )
    return (f"<details class=constant><summary>{len(const)} constant metric(s), not plotted "
            "(the same value at every step logged)</summary><table class=constant>"
            f"<tr><th>metric</th><th>value</th><th>steps logged</th></tr>{rows}</table></details>")


def _fmt_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return f"{v:.6g}"


def render_html(run_dir: Path, data: RunData) -> str:
    """The report page for ``data`` (read from ``run_dir``)."""
    metrics = data.metrics
    parts = [f"<h1>grpokit run report: {_e(run_dir.resolve().name)}</h1>"]
    facts = [f"run directory <code>{_e(run_dir.resolve())}</code>",
             f"generated {_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}"]
    if metrics:
        facts.append(f"{len(metrics)} steps logged (step {metrics[0]['step']} to {metrics[-1]['step']})")
        times = [r["time"] for r in metrics
                 if isinstance(r.get("time"), (int, float)) and math.isfinite(r["time"])]
        if len(times) >= 2:
            facts.append(f"wall clock {_dt.timedelta(seconds=round(max(times) - min(times)))}")
    names = list(dict.fromkeys(a.name for a in data.alarms))
    facts.append('health: <a href="#health">no alarm fired</a>' if not names else
                 f'health: <a href="#health" class=warn>{len(names)} alarm{"s" if len(names) > 1 else ""} '
                 f'fired ({_e(", ".join(names))})</a>')
    parts.append("<p>" + " · ".join(facts) + "</p>")

    groups = group_signals(metrics)
    all_keys = [k for keys in groups.values() for k in keys]
    steps = np.array([r["step"] for r in metrics], dtype=float) if metrics else None
    columns = _columns(metrics, all_keys)
    marks = _alarm_marks(data.alarms)
    th = health_thresholds(data.config)
    bands = alarm_bands(th.health, steps if steps is not None else np.zeros(0), columns)

    parts.append('<h2 id="signals">Health signals</h2>')
    parts.append(
        "<p class=lede>The GRPO health signals. Faint line: the value logged at each step; solid "
        "line: its centred moving average over the W nearest logged values (W grows with the run: "
        "about one in 25 values, 5 to 51; fewer at both ends). Dashed red lines with the light red "
        "side: the health monitor's alarm thresholds; orange (warn) or red (stop) verticals: steps "
        "where an alarm fired; red crosses on the axis: NaN/inf values.</p>")
    parts.append('<div class="signals">' + "".join(
        _signal_html(key, label, steps, columns, marks, bands) for key, label in LEADING_SIGNALS
    ) + "</div>")
    parts.append(_bands_html(th, bands))

    parts.append('<h2 id="health">Health</h2>' + _health_html(data.alarms, len(metrics)))
    parts.append("<h3>Non-finite guard</h3>" + _guard_html(data.guard_events))
    if data.notes:
        items = "".join(f"<li>{_e(n)}</li>" for n in data.notes)
        parts.append(f"<h2>Notes</h2><ul class=notes>{items}</ul>")

    parts.append('<h2 id="metrics">Other metrics</h2>')
    leading = {k for k, _ in LEADING_SIGNALS}
    rest = {ns: [k for k in keys if k not in leading] for ns, keys in groups.items()}
    const = constant_metrics(metrics, [k for keys in rest.values() for k in keys])
    plotted = {ns: [k for k in keys if k not in const] for ns, keys in rest.items()}
    plotted = {ns: keys for ns, keys in plotted.items() if keys}
    if not groups:
        parts.append("<p>No metrics were recorded (metrics.jsonl missing, empty or without "
                     "numeric values).</p>")
    elif not plotted and not const:
        parts.append("<p>The run logged no metric besides the health signals.</p>")
    else:
        parts.append("<p>Every other metric, by namespace. Vertical lines and shaded spans mark "
                     "alarm steps (orange: warn, red: stop) on the metrics each rule reads; dashed "
                     "red lines are alarm thresholds; red crosses mark NaN/inf values.</p>")
        parts.append(_constant_html(const, len(metrics)))
        for ns, keys in plotted.items():
            png = base64.b64encode(plot_namespace(keys, steps, columns, marks, bands)).decode("ascii")
            parts.append(f"<h3>{_e(ns)}</h3><img alt=\"{_e(ns)} metrics: {_e(', '.join(keys))}\" "
                         f"src=\"data:image/png;base64,{png}\">")

    parts.append("<h2>Samples</h2>" + _samples_html(data.samples, data.n_sample_files))
    parts.append("<h2>Config</h2>")
    if data.config_text is None:
        parts.append("<p>No config.yaml in the run directory.</p>")
    else:
        parts.append(f"<pre class=config>{_e(data.config_text)}</pre>")
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>grpokit report: {_e(run_dir.resolve().name)}</title><style>{_CSS}</style></head>"
        f"<body>{''.join(parts)}</body></html>\n"
    )


def write_report(run_dir: str | os.PathLike[str]) -> Path:
    """Write ``RUN_DIR/report.html`` and return its path (FileNotFoundError if no such dir)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    page = render_html(run_dir, load_run(run_dir))
    out = run_dir / REPORT_FILE
    tmp = out.with_name(f".{REPORT_FILE}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # atomic: a reader never sees half a report
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m grpokit.monitor.report RUN_DIR")
    print(write_report(sys.argv[1]))
