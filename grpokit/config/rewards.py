"""Config sections `rewards` (a list of `RewardSpecConfig`) and `crosscheck`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from grpokit._names import did_you_mean
from grpokit.config.base import RewardName, _Section, check_failed
from grpokit.rewards.compose import TimeoutS


class RewardSpecConfig(_Section):
    name: RewardName
    """Registered reward name (`grpokit.rewards.REGISTRY`; add one with `grpokit.rewards.register`),
    or a function of your own by import reference: `my_rewards:score` (a module on sys.path or in
    the current directory), `my_rewards.score`, or `path/to/file.py:score`."""
    weight: float = 1.0
    """Weight in the summed reward."""
    args: dict[str, Any] = {}
    """Keyword arguments bound to the reward function."""
    timeout_s: TimeoutS = "auto"
    """Time budget in seconds for one call (all samples of the batch); over it the batch scores None
    and an error is counted, and training goes on. `auto`: 300 s
    (`grpokit.rewards.compose.DEFAULT_TIMEOUT_S`), or no budget for a reward that enforces its own
    per-sample limits (math_accuracy, math_accuracy_alt, code_tests: a slow answer scores 0 there,
    while a batch over the budget would score None). `null`: no budget (a hanging reward then
    stalls training; only for a reward that must run in the main thread, e.g. one that sets signal
    handlers)."""

    @model_validator(mode="after")
    def _args_fit(self):
        """The args must be the reward's own parameters, of the right types, and the columns it
        will read must be nameable (e.g. length_group's verifier must exist): checked now, not at
        the first scoring."""
        from grpokit.rewards import check_args, required_columns, resolve

        fn = resolve(self.name)
        check_args(self.name, fn, self.args)
        required_columns(fn, self.args)
        return self


class CrossCheckConfig(_Section):
    primary: str
    """The reward whose scores are checked (one of `rewards`)."""
    checker: RewardName = "math_accuracy_alt"
    """An independent checker: a registered reward name."""
    fraction: float = Field(0.1, ge=0, le=1)
    """Share of completions checked each step."""
    checker_args: dict[str, Any] | None = None
    """Arguments for the checker (default: the primary's arguments it accepts)."""
    tol: float = Field(1e-6, ge=0)
    """Checker and primary scores further apart than this disagree."""
    timeout_s: TimeoutS = "auto"
    """Time budget in seconds for one checker call (over it the checked samples count in
    `reward/checker/errors`); `auto`: 300 s, or no budget for a checker with its own per-sample
    limits (math_accuracy_alt); `null`: no budget."""


    def check_config(self, cfg) -> None:
        names = [r.name for r in cfg.rewards]
        if self.primary not in names:
            raise check_failed(f"crosscheck.primary '{self.primary}' is not one of the rewards "
                               f"({', '.join(names)}){did_you_mean(self.primary, names)}")
