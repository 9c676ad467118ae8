"""`HealthMonitor`, the orchestration of the health rules: it keeps the history, runs every enabled
rule after each step, appends each alarm to ``RUN_DIR/alarms.jsonl``, prints each alarm name once
(with its advice), and says whether an alarm configured ``stop`` has fired. It also writes the
thresholds it runs with, its resolved `HealthConfig`, to ``RUN_DIR/health_config.json``, which the
report reads to draw them. Also the plain-words summary of alarms (`AlarmTally`, `tally_alarms`,
`summarize_alarms`), which the report reuses.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from grpokit.monitor.health.base import RULES, Alarm, AlarmConfig
from grpokit.monitor.health.config import HealthConfig
from grpokit.monitor.sinks import atomic_write_text, truncate_jsonl

ALARMS_FILE = "alarms.jsonl"
HEALTH_CONFIG_FILE = "health_config.json"
"""The monitor's `HealthConfig` as JSON (``HealthConfig.model_dump()``: every field, with the values
the trainer filled in, e.g. `kl_climbing.kl_high`): the thresholds this run's alarms used."""


@dataclasses.dataclass
class AlarmTally:
    """What the summary needs about one alarm name: first and latest firing, and a count."""

    first: Alarm
    last: Alarm
    count: int = 1
    stopped: bool = False

    def add(self, alarm: Alarm) -> None:
        if alarm.step < self.first.step:
            self.first = alarm
        if alarm.step >= self.last.step:
            self.last = alarm
        self.count += 1
        self.stopped = self.stopped or alarm.severity == "stop"


def tally_alarms(alarms: Iterable[Alarm | Mapping[str, Any]]) -> dict[str, AlarmTally]:
    """Alarms (objects or alarms.jsonl rows) grouped by name, in order of first firing."""
    tallies: dict[str, AlarmTally] = {}
    for a in alarms:
        _add(tallies, a if isinstance(a, Alarm) else Alarm.from_dict(a))
    return dict(sorted(tallies.items(), key=lambda kv: kv[1].first.step))


def _add(tallies: dict[str, AlarmTally], alarm: Alarm) -> None:
    if alarm.name in tallies:
        tallies[alarm.name].add(alarm)
    else:
        tallies[alarm.name] = AlarmTally(alarm, alarm, 1, alarm.severity == "stop")


def summarize_alarms(
    alarms: Iterable[Alarm | Mapping[str, Any]] | Mapping[str, AlarmTally],
    n_steps: int | None = None,
) -> str:
    """A plain-words health summary of alarms (objects, alarms.jsonl rows, or a tally)."""
    tallies = alarms if isinstance(alarms, Mapping) else tally_alarms(alarms)
    span = f" in {n_steps} steps" if n_steps is not None else ""
    if not tallies:
        return f"Healthy: no alarm fired{span}."
    n = len(tallies)
    lines = [f"{n} alarm{'s' if n > 1 else ''} fired{span}."]
    stops = [name for name, t in tallies.items() if t.stopped]
    if stops:
        lines[0] += f" Training was asked to stop by: {', '.join(stops)}."
    for name, t in tallies.items():
        times = "once" if t.count == 1 else f"{t.count} times"
        when = (
            f"at step {t.first.step}" if t.count == 1
            else f"from step {t.first.step} to step {t.last.step}"
        )
        lines.append(
            f"- {name} ({t.last.severity}) fired {times}, {when}. {t.last.message} "
            f"Advice: {t.last.advice}"
        )
    return "\n".join(lines)


class HealthMonitor:
    """Runs the enabled rules after each step; logs, prints once, and tracks ``stop`` alarms.

    The history keeps only ``step`` and the metrics some registered rule reads, and only the first
    ``history_head`` plus the last ``history_limit`` steps, so an update stays cheap and its state
    small. ``run_dir=None`` keeps everything in memory (no alarms.jsonl). ``print_fn`` receives
    each alarm name's first announcement (default: ``print``).

    With a run directory, the first `update` writes ``RUN_DIR/health_config.json`` (`HEALTH_CONFIG_FILE`,
    replaced atomically): at the first step, not at construction, so it lands after the trainer has
    set an earlier run's output aside, like alarms.jsonl.
    """

    def __init__(
        self,
        config: HealthConfig,
        run_dir: str | os.PathLike[str] | None,
        *,
        print_fn: Callable[[str], Any] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.print_fn = print_fn if print_fn is not None else print
        keys = [k for rule in RULES.values() for k in rule.keys]
        self._keys = frozenset(k for k in keys if "*" not in k)
        self._patterns = tuple(k for k in keys if "*" in k)
        self._history: list[dict[str, float]] = []
        self._tallies: dict[str, AlarmTally] = {}
        self._printed: set[str] = set()
        self._stop = False
        self._n_steps = 0  # steps monitored (the history itself is capped)
        self._config_written = False

    @property
    def history(self) -> list[dict[str, float]]:
        """The metric history the rules see."""
        return self._history

    @property
    def should_stop(self) -> bool:
        """True once an alarm whose action is ``stop`` has fired."""
        return self._stop

    def _params(self, name: str) -> AlarmConfig:
        params = getattr(self.config, name, None)
        return params if isinstance(params, AlarmConfig) else RULES[name].params_type()

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[Alarm]:
        """Add one step's metrics, run the rules and return the alarms fired at this step.

        A step not after the last one (a rollback or a replay) first drops the history from that
        step on, so rules never see two rows for one step.
        """
        step = int(step)
        if not self._config_written:
            self.write_config()
        while self._history and self._history[-1]["step"] >= step:
            self._history.pop()
            self._n_steps -= 1
        self._n_steps += 1
        entry: dict[str, float] = {"step": step}
        for key in metrics:
            if key not in self._keys and not any(fnmatch.fnmatchcase(key, pat) for pat in self._patterns):
                continue
            v = metrics[key]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                entry[key] = float(v)
        self._history.append(entry)
        head = self.config.history_head
        if len(self._history) > head + self.config.history_limit:
            del self._history[head]  # drop the oldest step after the head

        fired = []
        for name, rule in RULES.items():
            params = self._params(name)
            if params.action != "off":
                alarm = rule.fn(self._history, params)
                if alarm is not None:
                    fired.append(alarm)
        if fired and self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / ALARMS_FILE, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(a.to_dict()) + "\n" for a in fired)
        for alarm in fired:
            _add(self._tallies, alarm)
            self._stop = self._stop or alarm.severity == "stop"
            if alarm.name not in self._printed:
                self._printed.add(alarm.name)
                stop = " Training will stop." if alarm.severity == "stop" else ""
                self.print_fn(
                    f"[health] step {alarm.step}: {alarm.name} ({alarm.severity}) {alarm.message}"
                    f"{stop}\n  advice: {alarm.advice}"
                )
        return fired

    def write_config(self) -> None:
        """Write ``RUN_DIR/health_config.json``: the thresholds the rules run with (nothing without a
        run directory)."""
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / HEALTH_CONFIG_FILE,
                              json.dumps(self.config.model_dump(), indent=2) + "\n")
        self._config_written = True

    def summary(self) -> str:
        """The health of the run so far, in plain words."""
        return summarize_alarms(self._tallies, n_steps=self._n_steps)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, so a resumed run keeps its history and printed alarms."""
        return {
            "history": [dict(e) for e in self._history],
            "tallies": {
                name: {"first": t.first.to_dict(), "last": t.last.to_dict(), "count": t.count,
                       "stopped": t.stopped}
                for name, t in self._tallies.items()
            },
            "printed": sorted(self._printed),
            "stop": self._stop,
            "n_steps": self._n_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint's state. alarms.jsonl then loses its rows after the checkpoint's
        last step (all of them for a step-0 checkpoint, whose history is empty), as the trainer
        truncates metrics.jsonl, so a resumed run logs them once."""
        self._history = [dict(e) for e in state.get("history", [])]
        self._tallies = {
            name: AlarmTally(
                Alarm.from_dict(t["first"]), Alarm.from_dict(t["last"]), int(t["count"]),
                bool(t["stopped"]),
            )
            for name, t in state.get("tallies", {}).items()
        }
        self._printed = set(state.get("printed", []))
        self._stop = bool(state.get("stop", False))
        self._n_steps = int(state.get("n_steps", len(self._history)))
        self._truncate_log_after(self._history[-1]["step"] if self._history else 0)

    def _truncate_log_after(self, step: int) -> None:
        if self.run_dir is not None:
            truncate_jsonl(self.run_dir / ALARMS_FILE, step)
