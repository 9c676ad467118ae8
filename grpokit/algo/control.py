"""KL-coefficient (β) controllers behind one small interface.

A controller holds the β for the *current* update. After the update the trainer calls
``beta_next = ctrl.step(observed_kl)`` with the KL it measured (any consistent estimate, e.g. the
mean per-token k3 to the reference); the return value is the β to use for the next update.
``state_dict()`` / ``load_state_dict()`` make it resumable. ``build_controller(kind, **kwargs)``
builds one by name: fixed, adaptive, ziegler, warmup, schedule. ``warmup`` (cosine, linear or
step-shaped) and ``schedule`` multiply the β of an ``inner`` controller (default: fixed), so they
compose, e.g.
``build_controller("warmup", inner={"kind": "adaptive", ...}, steps=50)``; the inner controller is
stepped on every call and still sees the observed KL. A non-finite observed KL raises ValueError:
the caller should skip the step instead.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from grpokit._names import lookup, register

__all__ = [
    "AdaptiveKL",
    "CONTROLLERS",
    "FixedKL",
    "KLController",
    "ScheduleKL",
    "WarmupKL",
    "ZieglerKL",
    "build_controller",
    "register_controller",
]


@runtime_checkable
class KLController(Protocol):
    @property
    def beta(self) -> float: ...

    def step(self, observed_kl: float) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _check_kl(observed_kl: float) -> float:
    kl = float(observed_kl)
    if not math.isfinite(kl):
        raise ValueError(f"observed KL must be finite, got {kl}; skip the controller step instead")
    return kl


def _check_kind(state: dict, kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state_dict is for controller {got!r}, not {kind!r}")


def _finite(name: str, value, low: float = 0.0) -> float:
    """A finite float >= low, or ValueError naming the argument."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not (math.isfinite(v) and v >= low):
        raise ValueError(f"{name} must be finite and >= {low}, got {value!r}")
    return v


def _state_value(state: dict, key: str, kind: str, low: float = 0.0, high: float = math.inf) -> float:
    """state[key] checked (present, finite, in [low, high]) so a bad checkpoint fails loudly."""
    if key not in state:
        raise ValueError(f"{kind} controller state has no {key!r}: {state!r}")
    v = _finite(f"{kind} controller state {key!r}", state[key], low)
    if v > high:
        raise ValueError(f"{kind} controller state {key!r} = {v} is above its bound {high}")
    return v


class FixedKL:
    """β constant (verl ``kl_ctrl.type=fixed``; TRL ``beta``)."""

    kind = "fixed"

    def __init__(self, beta: float):
        self._beta = _finite("beta", beta)

    @property
    def beta(self) -> float:
        return self._beta

    def step(self, observed_kl: float) -> float:
        _check_kl(observed_kl)
        return self._beta

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "beta": self._beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self._beta = _state_value(state, "beta", self.kind)


class AdaptiveKL:
    """Target-band controller: β ← β·factor if KL > high, β ← β/factor if KL < low, else unchanged;
    then clipped to [beta_min, beta_max]. The multiplicative band rule is the PPO-penalty rule of
    Schulman et al. 2017 (PPO paper §4, which uses factor 2 and band [d/1.5, 1.5d]); default
    factor here is 1.5. beta_min > 0 by default so β can always grow back.
    """

    kind = "adaptive"

    def __init__(
        self,
        beta: float,
        low: float,
        high: float,
        *,
        factor: float = 1.5,
        beta_min: float = 1e-6,
        beta_max: float = 10.0,
    ):
        low, high, factor = _finite("low", low), _finite("high", high), _finite("factor", factor)
        beta, beta_min, beta_max = _finite("beta", beta), _finite("beta_min", beta_min), _finite("beta_max", beta_max)
        if not low <= high:
            raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
        if not factor > 1:
            raise ValueError(f"factor must be > 1, got {factor!r}")
        if not (beta_min <= beta <= beta_max):
            raise ValueError(
                f"need 0 <= beta_min <= beta <= beta_max, got {beta_min}, {beta}, {beta_max}"
            )
        self.low, self.high, self.factor = float(low), float(high), float(factor)
        self.beta_min, self.beta_max = float(beta_min), float(beta_max)
        self._beta = float(beta)

    @property
    def beta(self) -> float:
        return self._beta

    def step(self, observed_kl: float) -> float:
        kl = _check_kl(observed_kl)
        if kl > self.high:
            self._beta *= self.factor
        elif kl < self.low:
            self._beta /= self.factor
        self._beta = min(max(self._beta, self.beta_min), self.beta_max)
        return self._beta

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "beta": self._beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self._beta = _state_value(state, "beta", self.kind, self.beta_min, self.beta_max)


class ZieglerKL:
    """Proportional controller of Ziegler et al. 2019 (arXiv 1909.08593 §2.2):

        e = clip(KL/target − 1, −0.2, 0.2);   β ← β·(1 + K·e)

    K = n_steps/horizon as in lm-human-preferences ``train_policy.py`` and verl (n_steps = episodes
    per update, horizon default 10000), or given directly as ``k_beta`` (the paper's 0.1, the
    default when neither is given). The linear factor is the paper's and code's, not exp(K·e).
    """

    kind = "ziegler"

    def __init__(
        self,
        beta: float,
        target: float,
        *,
        horizon: float = 10000.0,
        n_steps: int | None = None,
        k_beta: float | None = None,
    ):
        beta, target = _finite("beta", beta), _finite("target", target)
        if not target > 0:
            raise ValueError(f"need beta >= 0 and target > 0, got beta={beta}, target={target}")
        if n_steps is not None and k_beta is not None:
            raise ValueError("give n_steps (with horizon) or k_beta, not both")
        if n_steps is not None:
            if not (horizon > 0 and n_steps > 0):
                raise ValueError(f"need n_steps > 0 and horizon > 0, got {n_steps}, {horizon}")
            k_beta = n_steps / horizon
        self.k_beta = 0.1 if k_beta is None else float(k_beta)
        if not 0 <= self.k_beta < 5:  # K·0.2 < 1 keeps β positive
            raise ValueError(f"k_beta must be in [0, 5), got {self.k_beta}")
        self.target = float(target)
        self._beta = float(beta)

    @property
    def beta(self) -> float:
        return self._beta

    def step(self, observed_kl: float) -> float:
        kl = _check_kl(observed_kl)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self._beta *= 1.0 + self.k_beta * error
        return self._beta

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "beta": self._beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self._beta = _state_value(state, "beta", self.kind)


def decay(progress: float, shape: str) -> float:
    """1 → 0 as progress goes 0 → 1 (clamped): half a cosine, or a line. Shared by the KL schedule
    and the learning-rate schedule."""
    p = min(max(progress, 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * p)) if shape == "cosine" else 1.0 - p


class _Scaled:
    """β = inner.β · scale(t), t = number of completed steps. Subclasses define ``scale``."""

    kind = ""

    def __init__(self, inner: KLController | None, beta: float | None):
        if inner is None:
            if beta is None:
                raise ValueError(f"controller {self.kind!r} needs beta or inner")
            inner = FixedKL(beta)
        elif beta is not None:
            raise ValueError(f"controller {self.kind!r}: give beta or inner, not both")
        self.inner, self.t = inner, 0

    def scale(self, t: int) -> float:
        raise NotImplementedError

    @property
    def beta(self) -> float:
        return self.inner.beta * self.scale(self.t)

    def step(self, observed_kl: float) -> float:
        self.inner.step(observed_kl)
        self.t += 1
        return self.beta

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "t": self.t, "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        t = int(_state_value(state, "t", self.kind))
        if "inner" not in state:
            raise ValueError(f"{self.kind} controller state has no 'inner': {state!r}")
        self.inner.load_state_dict(state["inner"])      # checks its own state before changing anything
        self.t = t


def _check_shape(shape: str, allowed: tuple[str, ...]) -> str:
    if shape not in allowed:
        raise ValueError(f"shape must be one of {allowed}, got {shape!r}")
    return shape


class WarmupKL(_Scaled):
    """High β early, then the inner controller's β.

    ``cosine`` / ``linear``: scale = 1 + (start_scale − 1)·w(t/steps), w decaying 1 → 0 by half a
    cosine or linearly; scale = 1 from t = steps on. ``step``: scale = start_scale while
    t < steps, then 1: a larger β held for the first ``steps`` updates, then dropped at once.
    At t = 0, β = start_scale·β_inner in every shape.

    The default start_scale, 4, turns the config's default β of 0.02 into 0.08 during the warm-up:
    inside the 0.05–0.1 of the warm-up rule in docs/algorithms.md §5 (0.05–0.1 for ~1000 updates,
    then 0.02). The inner controller is stepped during the warm-up too, so an adaptive inner keeps
    adapting there; to drop back to exactly the starting β, warm up over a fixed one, or ``hold``:
    the inner controller is not stepped until the warm-up ends, so it takes over from its own
    starting β (the default run's controller: `algorithm.kl.warmup_steps`). ``handed_over`` is True
    right after the step that ended the warm-up.
    """

    kind = "warmup"

    def __init__(
        self,
        inner: KLController | None = None,
        *,
        beta: float | None = None,
        steps: int,
        start_scale: float = 4.0,
        shape: str = "cosine",
        hold: bool = False,
    ):
        super().__init__(inner, beta)
        if not isinstance(hold, bool):
            raise ValueError(f"hold must be true or false, got {hold!r}")
        steps, start_scale = _finite("steps", steps, 0 if hold else 1), _finite("start_scale", start_scale, 1)
        if steps != int(steps):
            raise ValueError(f"steps must be a whole number of updates, got {steps!r}")
        self.steps, self.start_scale = int(steps), float(start_scale)
        self.shape = _check_shape(shape, ("linear", "cosine", "step"))
        self.hold = hold

    def step(self, observed_kl: float) -> float:
        if self.hold and self.t < self.steps:
            _check_kl(observed_kl)
            self.t += 1
            return self.beta
        return super().step(observed_kl)

    @property
    def handed_over(self) -> bool:
        return self.steps > 0 and self.t == self.steps

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.hold:
            out["steps"] = self.steps
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A held warm-up resumes with the length it started with (saved with it): the default's
        length follows `train.steps`, which a resumed run may have raised. A state saved before
        warm-ups held (the inner controller's alone) loads as a controller already in charge."""
        if self.hold and state.get("kind") == self.inner.kind:
            self.inner.load_state_dict(state)
            self.t = max(self.t, self.steps)
            return
        super().load_state_dict(state)
        if self.hold and "steps" in state:
            self.steps = int(_state_value(state, "steps", self.kind))

    def scale(self, t: int) -> float:
        if self.shape == "step":
            return self.start_scale if t < self.steps else 1.0
        return 1.0 + (self.start_scale - 1.0) * decay(t / self.steps, self.shape)


class ScheduleKL(_Scaled):
    """Late-training scale-down: scale = 1 until t = start_frac·total_steps, then decays to
    final_scale at t = total_steps ("linear" or "cosine"), or jumps to it ("step"); final_scale
    after."""

    kind = "schedule"

    def __init__(
        self,
        inner: KLController | None = None,
        *,
        beta: float | None = None,
        total_steps: int,
        start_frac: float = 0.8,
        final_scale: float = 0.1,
        shape: str = "linear",
    ):
        super().__init__(inner, beta)
        total_steps, start_frac = _finite("total_steps", total_steps, 1), _finite("start_frac", start_frac)
        final_scale = _finite("final_scale", final_scale)
        if not (total_steps >= 1 and 0 <= start_frac <= 1 and final_scale >= 0):
            raise ValueError(
                f"need total_steps >= 1, 0 <= start_frac <= 1, final_scale >= 0; got "
                f"{total_steps}, {start_frac}, {final_scale}"
            )
        self.total_steps, self.start_frac = int(total_steps), float(start_frac)
        self.final_scale = float(final_scale)
        self.shape = _check_shape(shape, ("linear", "cosine", "step"))

    def scale(self, t: int) -> float:
        start = self.start_frac * self.total_steps
        if t < start:
            return 1.0
        if self.shape == "step" or start >= self.total_steps:
            return self.final_scale
        w = decay((t - start) / (self.total_steps - start), self.shape)
        return self.final_scale + (1.0 - self.final_scale) * w


CONTROLLERS: dict[str, type] = {
    c.kind: c for c in (FixedKL, AdaptiveKL, ZieglerKL, WarmupKL, ScheduleKL)
}


def register_controller(name: str, cls: type | None = None, *, overwrite: bool = False):
    """Register a controller class under ``name`` (also a decorator). ``cls(beta=..., **args)``
    must build a ``KLController``; config selects it with ``algorithm.kl.controller: name`` and
    passes ``algorithm.kl.controller_args`` as its arguments."""
    return register(CONTROLLERS, name, cls, what="KL controller", overwrite=overwrite)


def build_controller(kind: str, **kwargs: Any) -> KLController:
    """Build a controller by name. For warmup / schedule, ``inner`` may be a controller or a dict
    ``{"kind": ..., **kwargs}`` (built recursively); without ``inner``, ``beta`` gives a fixed one.
    """
    lookup(CONTROLLERS, kind, "KL controller")
    inner = kwargs.get("inner")
    if isinstance(inner, dict):
        inner = dict(inner)
        kwargs["inner"] = build_controller(inner.pop("kind", "fixed"), **inner)
    try:
        return CONTROLLERS[kind](**kwargs)
    except TypeError as e:  # unknown / missing keyword: report it as a config error
        raise ValueError(f"KL controller {kind!r}: {e}") from None
