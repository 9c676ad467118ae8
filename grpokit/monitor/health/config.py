"""`HealthConfig`: the per-alarm configs (its field names are the rule names) and the history the
rules see. Importing it registers the built-in rules into `RULES` in its field order: the order the
monitor runs them and reports their alarms."""

from __future__ import annotations

from pydantic import Field

from grpokit.monitor.health.base import BUILTIN_RULES, _Strict, register_rule
from grpokit.monitor.health.kl import KLClimbingConfig, RefDriftConfig
from grpokit.monitor.health.policy import EntropyCollapseConfig, LengthExplosionConfig
from grpokit.monitor.health.reward import NoSignalConfig, RewardHackingConfig, RewardsMissingConfig


class HealthConfig(_Strict):
    """Per-alarm settings (the field names are the rule names) and the history the rules see."""

    history_head: int = Field(50, ge=0)
    """First steps always kept in the history (the early baselines, e.g. early entropy)."""
    history_limit: int = Field(5000, ge=100)
    """Most recent steps kept besides the head; older ones are dropped so an update and the
    monitor's checkpoint state stay small. Every default rule looks back far less than this."""

    kl_climbing: KLClimbingConfig = Field(default_factory=KLClimbingConfig)
    """KL to the reference rising steadily, or above the controller's target range."""
    length_explosion: LengthExplosionConfig = Field(default_factory=LengthExplosionConfig)
    """Mean completion length jumping to a multiple of its recent baseline."""
    no_signal: NoSignalConfig = Field(default_factory=NoSignalConfig)
    """Groups whose rewards are all equal, so advantages carry no signal."""
    reward_hacking: RewardHackingConfig = Field(default_factory=RewardHackingConfig)
    """Training reward rising while held-out accuracy does not, or answer checkers disagreeing."""
    entropy_collapse: EntropyCollapseConfig = Field(default_factory=EntropyCollapseConfig)
    """Policy entropy fallen far below its early value or an absolute floor."""
    ref_drift: RefDriftConfig = Field(default_factory=RefDriftConfig)
    """Reference log-probs changing although the reference must stay frozen."""
    rewards_missing: RewardsMissingConfig = Field(default_factory=RewardsMissingConfig)
    """Most of a step's completions without a reward (None, an error or a timeout)."""



def _register_builtin_rules() -> None:
    """Every built-in rule into `RULES`, in `HealthConfig`'s field order; each must have a field."""
    missing = sorted(set(BUILTIN_RULES) - set(HealthConfig.model_fields))
    if missing:
        raise RuntimeError(f"built-in health rules without a HealthConfig field: {missing}")
    for name in HealthConfig.model_fields:
        if name in BUILTIN_RULES:
            rule = BUILTIN_RULES[name]
            register_rule(name, rule.params_type, rule.keys)(rule.fn)


_register_builtin_rules()
