"""What a run directory holds, read for the report (grpokit.monitor.report): metrics, alarms, the
health monitor's thresholds, guard events, samples from early, middle and late training, and the
config. Missing files, empty files and malformed lines never stop the reading: a malformed line is
skipped and noted."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from grpokit.monitor.health import ALARMS_FILE, HEALTH_CONFIG_FILE, Alarm

MAX_LINE_NOTES = 5  # bad lines listed one by one per file; the rest are counted
GUARD_FILE = "guard.jsonl"


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
    health_config: dict[str, Any] | None = None  # health_config.json: the thresholds the monitor used


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
    health_config = _load_health_config(run_dir / HEALTH_CONFIG_FILE, notes)
    return RunData(metrics, alarms, guard_events, samples, len(paths), config_text, notes, config,
                   health_config)


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


def _load_health_config(path: Path, notes: list[str]) -> dict[str, Any] | None:
    """The health monitor's thresholds (a JSON object), or None: absent (a run directory from
    before the monitor wrote it, or one without a step yet) or unreadable (noted)."""
    if not path.is_file():
        return None
    try:
        parsed = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as e:
        notes.append(f"{HEALTH_CONFIG_FILE}: could not be read ({e}); thresholds from config.yaml.")
        return None
    if not isinstance(parsed, dict):
        notes.append(f"{HEALTH_CONFIG_FILE}: not a JSON object; thresholds from config.yaml.")
        return None
    return parsed


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
