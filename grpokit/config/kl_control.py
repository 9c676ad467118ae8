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
        return build_controller(k.controller, **args)
    return build_controller(k.controller, beta=k.beta, **args)


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
