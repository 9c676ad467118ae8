"""Pure math core of grpokit: advantages, KL estimators, policy losses, aggregation, β control.

Functions over tensors and plain numbers only (no model, no config object, no I/O); the trainer
calls them. Each family with variants is a registry keyed by name with one signature:
``advantages.ESTIMATORS``, ``kl.KINDS``, ``loss.AGGREGATIONS``, ``control.CONTROLLERS``.
See docs/algorithms.md for the formulas, their sources and where we deviate.
"""

from grpokit.algo import advantages, control, kl, loss
from grpokit.algo.advantages import ESTIMATORS, quantile_edges, register_estimator
from grpokit.algo.advantages import compute as compute_advantages
from grpokit.algo.control import CONTROLLERS, KLController, build_controller, register_controller
from grpokit.algo.kl import KINDS as KL_KINDS
from grpokit.algo.kl import estimate as estimate_kl
from grpokit.algo.kl import kl_in_reward
from grpokit.algo.loss import AGGREGATIONS, aggregate, policy_loss

__all__ = [
    "AGGREGATIONS",
    "CONTROLLERS",
    "ESTIMATORS",
    "KLController",
    "KL_KINDS",
    "advantages",
    "aggregate",
    "build_controller",
    "compute_advantages",
    "control",
    "estimate_kl",
    "kl",
    "kl_in_reward",
    "loss",
    "policy_loss",
    "quantile_edges",
    "register_controller",
    "register_estimator",
]
