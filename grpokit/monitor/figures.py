"""The report's plots: metric grouping, smoothing and downsampling, the health alarms' thresholds
(the ones the run's health monitor wrote to RUN_DIR/health_config.json; for an older run directory
without it, worked out from its config.yaml as the trainer fills them in) and the matplotlib
figures. `grpokit.monitor.report` lays them out in the page.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from pydantic import ValidationError

from grpokit.monitor.health import HEALTH_CONFIG_FILE, RULES, Alarm, HealthConfig

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
    (``grpokit.config.kl_control.kl_target_high``), for a run directory without health_config.json,
    from its config.yaml mapping; None when that does not validate."""
    from grpokit.config import ConfigError, config_from_dict
    from grpokit.config.kl_control import kl_target_high as config_kl_target_high

    try:
        return config_kl_target_high(config_from_dict(dict(config)))
    except (ConfigError, ValueError, TypeError):
        return None


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The health monitor's settings as far as the run directory tells, and where they came from."""

    health: HealthConfig
    origin: str  # for the reader: "health_config.json", "config.yaml", or why the defaults are used
    filled: dict[str, str]  # "rule.field" -> where the trainer took that value from instead


def health_thresholds(config: Mapping[str, Any] | None, saved: Any = None) -> Thresholds:
    """The thresholds the run's health monitor used.

    ``saved``: the run's health_config.json as parsed (the monitor writes its resolved HealthConfig
    there). When given and valid, those are the thresholds, and `filled` names the two fields the
    trainer fills in (``build_health``) where they differ from config.yaml's ``health:`` (which
    holds the config as the user set it). Otherwise (an older run directory) they are worked out
    from config.yaml: its ``health:``, with `kl_climbing.kl_high` (the KL controller's upper
    target) and `ref_drift.tolerance` (`guard.ref_tolerance`) filled in when not set. config.yaml
    holds every field, set or not, so a null `kl_high` and a `ref_drift.tolerance` at its default
    count as not set. Defaults without config.yaml or when its ``health:`` does not validate."""
    why = ""
    if saved is not None:
        try:
            health = HealthConfig.model_validate(saved)
        except ValidationError as e:
            first = e.errors()[0].get("msg", "invalid") if e.errors() else "invalid"
            why = f"; {HEALTH_CONFIG_FILE} does not validate: {first}"
        else:
            high = health.kl_climbing.kl_high
            if high is not None and not math.isfinite(high):  # the level test can never fire
                health.kl_climbing.kl_high = None
            return Thresholds(health, HEALTH_CONFIG_FILE, _filled_by_trainer(health, config))
    th = _thresholds_from_config(config)
    return dataclasses.replace(th, origin=th.origin + why) if why else th


def _filled_by_trainer(health: HealthConfig, config: Mapping[str, Any] | None) -> dict[str, str]:
    """"rule.field" -> where the trainer took it from, for the fields it fills in whose saved value
    differs from config.yaml's ``health:`` (nothing when config.yaml is absent or invalid)."""
    if config is None:
        return {}
    try:
        asked = HealthConfig.model_validate(_mapping(config, "health"))
    except ValidationError:
        return {}
    filled: dict[str, str] = {}
    if asked.kl_climbing.kl_high is None and health.kl_climbing.kl_high is not None:
        filled["kl_climbing.kl_high"] = "the KL controller's upper target (algorithm.kl)"
    if asked.ref_drift.tolerance != health.ref_drift.tolerance:
        filled["ref_drift.tolerance"] = "guard.ref_tolerance"
    return filled


def _thresholds_from_config(config: Mapping[str, Any] | None) -> Thresholds:
    """`health_thresholds` of a run directory without health_config.json: from config.yaml."""
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
        if kl.kl_high is None:
            add(Band("kl/ref", "kl_climbing", "kl_climbing.min_kl",
                     f"min_kl {kl.min_kl:.3g}: a rise below it is ignored", kl.min_kl, None))
        else:                      # with a band the trend test reads the band's unit, its floor half the bound
            floor = kl.band_floor * kl.kl_high
            add(Band("kl/ref_seq" if kl.unit == "sequence" else "kl/ref", "kl_climbing", "kl_climbing.band_floor",
                     f"{kl.band_floor:g} x kl_high = {floor:.3g}: a rise below it is ignored", floor, None))
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
