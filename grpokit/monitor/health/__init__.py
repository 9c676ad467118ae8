"""Training-health alarms: small pure rules over the metric history, and the monitor that runs them.

A *rule* is a plain function ``rule(history, params) -> Alarm | None``. ``history`` is the list of
metric dicts logged so far, oldest first, each with a ``"step"`` key (the rows of
``metrics.jsonl``); ``params`` is that rule's own small config model. Rules read only the metrics
they declare, skip missing and non-finite values, and each needs a minimum amount of history before
it can fire, so the noise of a healthy short run stays quiet. Their formulas are in their
docstrings and in ``docs/metrics.md``.

``HealthMonitor`` is the orchestration: it keeps the history, runs every enabled rule after each
step, appends each alarm to ``RUN_DIR/alarms.jsonl``, prints each alarm name once (with its advice),
says whether an alarm configured ``stop`` has fired, and writes the thresholds it used to
``RUN_DIR/health_config.json``.

Modules: ``base`` (Alarm, the config base, the rule registry, history helpers), one per rule family
(``kl``: kl_climbing, ref_drift; ``policy``: length_explosion, entropy_collapse; ``reward``:
no_signal, reward_hacking, rewards_missing), ``config`` (HealthConfig; registers the rules in its
field order, the order alarms are run and reported) and ``monitor`` (HealthMonitor, the summary).
Every name is re-exported here.
"""

from grpokit.monitor.health.base import (
    RULES,
    Action,
    Alarm,
    AlarmConfig,
    History,
    Rule,
    kendall_tau,
    register_rule,
)
from grpokit.monitor.health.base import _head, _num, _slope, _step, _Strict, _tail  # noqa: F401 - tests read them
from grpokit.monitor.health.config import HealthConfig
from grpokit.monitor.health.kl import KLClimbingConfig, RefDriftConfig, kl_climbing, ref_drift
from grpokit.monitor.health.monitor import (
    ALARMS_FILE,
    HEALTH_CONFIG_FILE,
    AlarmTally,
    HealthMonitor,
    summarize_alarms,
    tally_alarms,
)
from grpokit.monitor.health.monitor import _add  # noqa: F401
from grpokit.monitor.health.policy import (
    EntropyCollapseConfig,
    LengthExplosionConfig,
    entropy_collapse,
    length_explosion,
)
from grpokit.monitor.health.reward import _eval_points  # noqa: F401
from grpokit.monitor.health.reward import (
    NoSignalConfig,
    RewardHackingConfig,
    RewardsMissingConfig,
    held_out_metric,
    no_signal,
    reward_hacking,
    rewards_missing,
)

__all__ = [
    "ALARMS_FILE",
    "HEALTH_CONFIG_FILE",
    "RULES",
    "Action",
    "Alarm",
    "AlarmConfig",
    "AlarmTally",
    "EntropyCollapseConfig",
    "HealthConfig",
    "HealthMonitor",
    "History",
    "KLClimbingConfig",
    "LengthExplosionConfig",
    "NoSignalConfig",
    "RefDriftConfig",
    "RewardHackingConfig",
    "RewardsMissingConfig",
    "Rule",
    "entropy_collapse",
    "held_out_metric",
    "kendall_tau",
    "kl_climbing",
    "length_explosion",
    "no_signal",
    "ref_drift",
    "register_rule",
    "reward_hacking",
    "rewards_missing",
    "summarize_alarms",
    "tally_alarms",
]
