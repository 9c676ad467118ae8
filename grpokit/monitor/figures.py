"""The report's plots: metric grouping, smoothing and downsampling, and the matplotlib figures
with the health alarms' thresholds (grpokit.monitor.thresholds) drawn on them.
`grpokit.monitor.report` lays them out in the page.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from grpokit.monitor.health import RULES, Alarm

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


from grpokit.monitor.thresholds import (  # noqa: F401 - the report imports them from here
    Band, Thresholds, alarm_bands, health_thresholds, kl_target_high, length_alarm_level)


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
