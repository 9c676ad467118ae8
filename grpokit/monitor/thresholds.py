"""The health alarms' thresholds as the report draws them: the ones the run's health monitor wrote
to RUN_DIR/health_config.json (for an older run directory without it, worked out from its
config.yaml as the trainer fills them in), and the bands each enabled rule draws on the signals it
reads. `grpokit.monitor.figures` draws them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from grpokit.monitor.health import HEALTH_CONFIG_FILE, RULES, HealthConfig


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
