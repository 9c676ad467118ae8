"""Rules on the KL to the reference: `kl_climbing` (KL rising steadily, or held above the KL
controller's target range) and `ref_drift` (the frozen reference's log-probs changing)."""

from __future__ import annotations

import math
import statistics
from typing import Literal

from pydantic import Field

from grpokit.monitor.health.base import Alarm, AlarmConfig, History, _step, _tail, builtin_rule, kendall_tau


class KLClimbingConfig(AlarmConfig):
    window: int = Field(20, ge=4)
    """Number of most recent `kl/ref` values the trend test looks at (also its minimum history)."""
    min_tau: float = Field(0.5, ge=-1.0, le=1.0)
    """Kendall's tau over the window at or above which the rise counts as steady."""
    rise_factor: float = Field(1.5, gt=1.0)
    """The median of the window's last quarter must be at least this multiple of its first."""
    min_kl: float = Field(0.05, ge=0.0)
    """KL (nats per token) below which a rising trend is ignored (early growth from zero). Used
    when no target band is known (`kl_high` None); with one, `band_floor` takes its place."""
    band_floor: float = Field(0.5, ge=0.0, le=1.0)
    """With a target band (`kl_high` set): the trend test reads KL in the band's unit and ignores a
    rise that stays below this fraction of `kl_high`: KL rising into the lower half of the band is
    the controller letting the policy learn, not beta failing to hold it."""
    kl_high: float | None = Field(None, gt=0.0)
    """Upper bound of the KL controller's target range; None disables the level test. The trainer
    copies it from its KL controller config."""
    unit: Literal["token", "sequence"] = "token"
    """The unit of `kl_high`: `token` compares it with `kl/ref`, `sequence` with `kl/ref_seq` (the
    KL of a whole completion). The trainer copies it from `algorithm.kl.target_unit`."""
    high_steps: int = Field(10, ge=1)
    """Consecutive `kl/ref` values above `kl_high` that fire the level test (an adaptive controller
    needs a few steps to pull KL back into its band, so this is not 1)."""



class RefDriftConfig(AlarmConfig):
    tolerance: float = Field(1e-4, ge=0.0)
    """Largest allowed `ref/integrity_drift` (nats); the trainer passes `guard.ref_tolerance`."""



@builtin_rule("kl_climbing", KLClimbingConfig, keys=("kl/ref", "kl/ref_seq"))
def kl_climbing(history: History, p: KLClimbingConfig) -> Alarm | None:
    """KL to the reference climbing steadily, or held above the controller's target range.

    Let x be the last ``window`` (W) finite values of the KL and q = W // 4: ``kl/ref`` (per
    token) without a target band; with one (``kl_high`` set), the band's unit (``kl/ref_seq``, per
    completion, for ``unit: sequence``), so that both tests read what the controller controls.
    Trend test (needs W values): fire when
        tau(x) ≥ min_tau   and   median(x[-q:]) ≥ rise_factor · median(x[:q])
        and   median(x[-q:]) ≥ floor,
    with tau Kendall's tau-a of x against time (1 = strictly increasing) and floor = ``min_kl``
    without a band, ``band_floor`` · kl_high with one (a rise into the band's lower half is the
    controller letting KL in: a short answer learning a new fact moves its per-token KL several
    fold while its per-completion KL stays low in the band).
    Level test (only when ``kl_high`` is set): fire when the last ``high_steps`` finite values are
    all > kl_high.  Value: the latest KL.
    """
    advice = (
        "The policy is moving away from the reference faster than the KL penalty holds it: raise the "
        "KL coefficient (or use the adaptive controller), lower the learning rate, or tighten the "
        "clip range."
    )
    if p.kl_high is not None:
        key = "kl/ref_seq" if p.unit == "sequence" else "kl/ref"
        high = _tail(history, key, p.high_steps)
        if len(high) == p.high_steps and min(high) > p.kl_high:
            return Alarm(
                "kl_climbing", _step(history), p.action,
                f"KL to the reference ({key}) has been above the target bound kl_high={p.kl_high:.3g} "
                f"for the last {p.high_steps} steps (now {high[-1]:.3g}).",
                advice, high[-1],
            )
    key, floor = "kl/ref", p.min_kl
    if p.kl_high is not None:
        key, floor = ("kl/ref_seq" if p.unit == "sequence" else "kl/ref"), p.band_floor * p.kl_high
    x = _tail(history, key, p.window)
    if len(x) < p.window:
        return None
    q = max(1, p.window // 4)
    first, last = statistics.median(x[:q]), statistics.median(x[-q:])
    tau = kendall_tau(x)
    if tau >= p.min_tau and last >= p.rise_factor * first and last >= floor:
        where = f", past {p.band_floor:g} of the target bound {p.kl_high:.3g}" if p.kl_high is not None else ""
        return Alarm(
            "kl_climbing", _step(history), p.action,
            f"KL to the reference ({key}) rose steadily from {first:.3g} to {last:.3g} over the "
            f"last {p.window} steps (Kendall tau {tau:.2f}){where}.",
            advice, x[-1],
        )
    return None



@builtin_rule("ref_drift", RefDriftConfig, keys=("ref/integrity_drift",))
def ref_drift(history: History, p: RefDriftConfig) -> Alarm | None:
    """Reference log-probs drifting: fire when the latest step logged ``ref/integrity_drift`` and
    it is > tolerance or not finite (NaN/inf reference log-probs are broken too).

    It is an exact integrity check (the reference is frozen), so one reading suffices; the probe
    runs every few steps, and the rule fires once per bad reading, not on the steps between.
    Value: the drift.
    """
    v = history[-1].get("ref/integrity_drift") if history else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    drift = float(v)
    if drift <= p.tolerance:  # NaN compares False: it fires
        return None
    what = f"moved by up to {drift:.3g} nats" if math.isfinite(drift) else f"became {drift}"
    return Alarm(
        "ref_drift", _step(history), p.action,
        f"Reference log-probs {what} on the probe batch (tolerance {p.tolerance:.3g}); KL to the "
        "reference is no longer trustworthy.",
        "The reference must stay frozen: check that its weights (or the LoRA base) are not updated "
        "or changed in place, and that it runs with the same dtype; resume from the last good "
        "checkpoint.",
        drift,
    )

