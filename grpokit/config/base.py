"""The shared parts of the config sections: the `_Section` base, the types of fields that name a
registered part (checked against its registry when the config is built) and `check_failed`, the
error a cross-field check raises."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from grpokit._names import lookup

# --------------------------------------------------------------------------- registered names
# A field that names a pluggable part is checked against its registry when the config is built,
# not against a fixed list: a name registered before then (`register_estimator`, `register_kind`,
# `register_aggregation`, `register_controller`, `register_engine`, `grpokit.rewards.register`) is
# accepted from YAML like a built-in one. The registries are imported only when a value is checked.
# A reward may also be an import reference to a user's function (grpokit.rewards.user), imported here.


def _registered(what: str, table: Callable[[], Mapping], listing: str = "known"):
    def check(name: str) -> str:
        lookup(table(), name, what, listing=listing)
        return name

    return Annotated[str, AfterValidator(check)]


def _estimators():
    from grpokit.algo.advantages import ESTIMATORS
    return ESTIMATORS


def _aggregations():
    from grpokit.algo.loss import AGGREGATIONS
    return AGGREGATIONS


def _kl_kinds():
    from grpokit.algo.kl import KINDS
    return KINDS


def _controllers():
    from grpokit.algo.control import CONTROLLERS
    return CONTROLLERS


def _engines():
    from grpokit.rollout.registry import ENGINES
    return ENGINES


def _reward(name: str) -> str:
    """A registered reward, or an import reference (`my_rewards:score`, `path/to/file.py:score`),
    imported and registered here (grpokit.rewards.user)."""
    from grpokit.rewards import resolve
    resolve(name)
    return name


AdvantageName = _registered("advantage estimator", _estimators)
AggregationName = _registered("loss aggregation", _aggregations)
KLKindName = _registered("KL estimator", _kl_kinds)
ControllerName = _registered("KL controller", _controllers)
EngineName = _registered("rollout engine", _engines)
RewardName = Annotated[str, AfterValidator(_reward)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    def check_config(self, cfg) -> None:
        """The checks of this section against other sections of the whole config `cfg` (fields of
        this section alone are checked by its own validators). Called by `grpokit.config.check_config`."""


CHECK_FAILED = "config_check"


def check_failed(message: str) -> PydanticCustomError:
    """The error of a cross-field check: `config_from_dict` reports its message as it is, one line
    without a key in front (the message names its keys itself), whichever section raised it."""
    return PydanticCustomError(CHECK_FAILED, "{message}", {"message": message})
