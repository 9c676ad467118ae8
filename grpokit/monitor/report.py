"""A self-contained HTML report of one run directory.

``write_report(run_dir)`` reads what the trainer and the health monitor wrote (``metrics.jsonl``,
``alarms.jsonl``, ``guard.jsonl``, ``config.yaml``, ``samples/step_*.jsonl``) and writes
``RUN_DIR/report.html``: the health summary, the updates the non-finite guard skipped and the
rollbacks with their causes, every logged signal plotted against the step (one small-multiples figure per
metric namespace, alarm steps marked on the plots of the metrics each rule reads), samples from
early, middle and late training with their reward breakdown, and the config. Plots are PNGs made
with matplotlib's Agg canvas and embedded as base64; the page loads nothing and runs no script.

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
from typing import Any

import numpy as np
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from grpokit.monitor.health import ALARMS_FILE, RULES, Alarm, summarize_alarms

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
    config_text = _load_config(run_dir / "config.yaml", notes)
    return RunData(metrics, alarms, guard_events, samples, len(paths), config_text, notes)


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


def _load_config(path: Path, notes: list[str]) -> str | None:
    """The config re-dumped as block YAML, the raw text if it does not parse, None if absent."""
    if not path.is_file():
        return None
    raw = path.read_text(encoding="utf-8", errors="replace")
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError:
        notes.append("config.yaml is not valid YAML; it is shown as written.")
        return raw
    if parsed is None:
        return ""
    return yaml.safe_dump(parsed, sort_keys=False, allow_unicode=True, default_flow_style=False,
                          width=100)


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


def plot_namespace(
    keys: Sequence[str],
    steps: np.ndarray,
    columns: Mapping[str, tuple[np.ndarray, np.ndarray]],
    marks: Mapping[str, list[tuple[str, str, list[tuple[int, int]]]]],
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
        ax.plot(x, y, "-", color="#1f77b4", linewidth=1.0, marker="o" if sparse else None, markersize=3)
        bad = logged & ~finite
        if bad.any():  # non-finite values: red crosses along the bottom edge
            ax.plot(steps[bad], np.full(bad.sum(), 0.03), "x", color="red", markersize=5,
                    transform=ax.get_xaxis_transform(), clip_on=False)
        title = key if not y.size else f"{key} (last {y[-1]:.4g})"
        if bad.any():
            title += f"\n{int(bad.sum())} non-finite"
        names = []
        for name, severity, runs in marks.get(key, ()):
            color = "#d62728" if severity == "stop" else "#ff7f0e"
            names.append(name)
            for first, last in runs:
                ax.axvline(first, color=color, linewidth=1.0, alpha=0.9)
                if last > first:
                    ax.axvspan(first, last, color=color, alpha=0.15, linewidth=0)
        if names:
            title += "\nalarm: " + ", ".join(names)
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3, linewidth=0.5)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


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
"""


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
    parts.append("<p>" + " · ".join(facts) + "</p>")

    parts.append("<h2>Health</h2>" + _health_html(data.alarms, len(metrics)))
    parts.append("<h3>Non-finite guard</h3>" + _guard_html(data.guard_events))
    if data.notes:
        items = "".join(f"<li>{_e(n)}</li>" for n in data.notes)
        parts.append(f"<h2>Notes</h2><ul class=notes>{items}</ul>")

    parts.append("<h2>Metrics</h2>")
    groups = group_signals(metrics)
    if not groups:
        parts.append("<p>No metrics were recorded (metrics.jsonl missing, empty or without "
                     "numeric values).</p>")
    else:
        steps = np.array([r["step"] for r in metrics], dtype=float)
        columns = _columns(metrics, [k for keys in groups.values() for k in keys])
        marks = _alarm_marks(data.alarms)
        parts.append("<p>Vertical lines and shaded spans mark alarm steps (orange: warn, red: stop) "
                     "on the metrics each rule reads; red crosses mark NaN/inf values.</p>")
        for ns, keys in groups.items():
            png = base64.b64encode(plot_namespace(keys, steps, columns, marks)).decode("ascii")
            parts.append(f"<h3>{_e(ns)}</h3><img alt=\"{_e(ns)} metrics\" "
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
