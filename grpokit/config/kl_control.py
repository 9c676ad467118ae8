"""The KL coefficient's controller from the config, and the KL value it aims at (light: the
report uses it without loading models)."""

from __future__ import annotations

from grpokit.algo.control import AdaptiveKL, ZieglerKL, build_controller


def build_kl_controller(cfg):
    """The controller of `algorithm.kl` (grpokit.algo.control): fixed at 0 when beta = 0; the
    adaptive controller's band and step factor from the config unless its `controller_args` say
    otherwise; warm-up and schedule wrap a fixed beta unless given `inner`."""
    k = cfg.algorithm.kl
    if k.beta == 0:
        return build_controller("fixed", beta=0.0)
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
    if holds_warmup(cfg):           # beta held high, the controller idle; then it takes over from beta
        ctl = build_controller("warmup", inner=ctl, steps=warmup_steps(cfg), start_scale=k.warmup_scale,
                               shape="step", hold=True)
    return ctl


def holds_warmup(cfg) -> bool:
    """Whether the controller comes wrapped in the held warm-up (`algorithm.kl.warmup_steps`): one
    that aims at a KL, always, even for a warm-up of 0 steps, so that a run resumed with another
    `train.steps` (hence another default length) finds the controller its checkpoint holds and
    keeps the length it started with."""
    k = cfg.algorithm.kl
    if k.beta == 0 or k.controller == "warmup":
        return False
    return bool(k.warmup_steps) or k.controller not in ("fixed", "schedule")     # asked for, or by default


def warmup_steps(cfg) -> int:
    """The steps of the KL warm-up (`algorithm.kl.warmup_steps`, its default resolved): a tenth of
    `train.steps`, at most 1000, before a controller that aims at a KL (adaptive, ziegler, or one
    registered); by default none at beta = 0 and for the fixed, warmup and schedule controllers
    (fixed and schedule take one when `warmup_steps` asks)."""
    k = cfg.algorithm.kl
    if not holds_warmup(cfg):
        return 0
    if k.warmup_steps is not None:
        return k.warmup_steps
    return min(1000, cfg.train.steps // 10)


def kl_target_high(cfg) -> float | None:
    """The upper end of the KL controller's target (in `algorithm.kl.target_unit`): `high` of the
    adaptive controller, `target` of Ziegler's, also when a warm-up or schedule wraps one; None for
    the others (fixed, or a wrapper around fixed), which aim at no KL value, and when beta = 0."""
    ctl = build_kl_controller(cfg)
    while hasattr(ctl, "inner"):                 # warmup / schedule scale an inner controller's beta
        ctl = ctl.inner
    if isinstance(ctl, AdaptiveKL):
        return ctl.high
    if isinstance(ctl, ZieglerKL):
        return ctl.target
    return None
