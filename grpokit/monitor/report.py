"""A self-contained HTML report of one run directory.

``write_report(run_dir)`` reads what the trainer and the health monitor wrote (``metrics.jsonl``,
``alarms.jsonl``, ``health_config.json``, ``guard.jsonl``, ``config.yaml``,
``samples/step_*.jsonl``) and writes
``RUN_DIR/report.html``. It leads with the GRPO health signals (``LEADING_SIGNALS``: policy loss,
KL to the reference, mean reward, response length, advantage std, token-level loss, held-out
pass@1), one plot each: the raw value faint, its centred moving average solid, the thresholds of
the health monitor's alarms that read it (as the monitor wrote them to health_config.json; from
config.yaml in an older run directory) drawn as dashed lines with the alarm side shaded, and
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
import datetime as _dt
import html
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpokit.monitor.figures import (  # noqa: F401 - some re-exported for callers of this module
    Band,
    LEADING_SIGNALS,
    Thresholds,
    _alarm_marks,
    _columns,
    _namespace,
    alarm_bands,
    centred_average,
    constant_metrics,
    downsample,
    group_signals,
    health_thresholds,
    kl_target_high,
    length_alarm_level,
    plot_namespace,
    plot_signal,
    signal_lines,
    smoothing_window,
)
from grpokit.monitor.health import ALARMS_FILE, HEALTH_CONFIG_FILE, Alarm, summarize_alarms  # noqa: F401
from grpokit.monitor.rundata import GUARD_FILE, RunData, load_run, read_jsonl  # noqa: F401 - re-exported

REPORT_FILE = "report.html"
SAMPLES_PER_PHASE = 4
MAX_TEXT = 1500  # characters of a prompt or completion shown before truncation
MAX_GUARD_ROWS = 50  # guard events listed; the rest are counted


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


def _episode_cell(spans: list[dict]) -> str:
    """A multi-turn episode: the policy's turns as they are, observations (masked out of the loss)
    marked."""
    parts, used = [], 0
    for sp in spans:
        text = str(sp.get("text", ""))[:max(0, MAX_TEXT - used)]
        used += len(text)
        parts.append(_e(text) if sp.get("trained") else f"<span class=obs>{_e(text)}</span>")
        if used >= MAX_TEXT:
            parts.append('<span class="muted"> … (cut)</span>')
            break
    return f"<pre>{''.join(parts)}</pre>"


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
                f"<td>{_episode_cell(r['spans']) if r.get('spans') else _text_cell(r.get('completion'))}"
                f"{_episode_note(r)}</td>"
                f"<td>{_text_cell(r['answer']) if 'answer' in r else '<span class=muted>—</span>'}</td>"
                f"<td>{_e(_fmt(r.get('reward')))}</td>"
                f"<td>{_breakdown(r.get('rewards'))}</td>"
                f"<td>{_e(_fmt(r.get('advantage')))}</td>"
                f"<td>{_e(_fmt(r.get('length')))}</td>"
                f"<td{' class=warn' if finish == 'length' else ''}>{_e(_fmt(finish))}</td>"
                "</tr>"
            )
    episodes = any(r.get("spans") for _, _, rows in phases for r in rows)
    legend = (" In multi-turn episodes, <span class=obs>shaded text</span> is an observation (a tool's or the "
              "environment's answer): never trained on." if episodes else "")
    return (f"<p>{n_files} sample file(s); up to {SAMPLES_PER_PHASE} completions per phase, spread "
            f"over the reward range.{legend}</p><table class=samples>{head}{''.join(body)}</table>")


def _episode_note(r: dict) -> str:
    if "stop_reason" not in r:
        return ""
    return (f"<br><span class=muted>{_e(r.get('turns'))} turns, {_e(r.get('tool_calls'))} tool calls "
            f"({_e(r.get('tool_errors'))} failed, {_e(r.get('parse_failures'))} unreadable); stopped: "
            f"{_e(r.get('stop_reason'))}</span>")


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
table.samples td{max-width:380px}.obs{background:#e8eef7;color:#345}ul{margin:0;padding-left:16px}
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
    th = health_thresholds(data.config, data.health_config)
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


def write_report_at_end(run_dir: str | os.PathLike[str], say=print) -> Path | None:
    """``write_report`` for the end of a run: says ``report: PATH``; a failure is logged, never
    raised, so it neither loses a finished run nor hides the error that stopped one."""
    try:
        path = write_report(run_dir)
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("grpokit").warning("could not write the report: %s", exc)
        return None
    say(f"report: {path}")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m grpokit.monitor.report RUN_DIR")
    print(write_report(sys.argv[1]))
