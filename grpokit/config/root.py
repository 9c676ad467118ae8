"""`Config`, the whole configuration: one field per section, and `check_config`, the one entry
point of the checks that span sections."""

from __future__ import annotations

import warnings

from pydantic import Field, field_validator, model_validator

from grpokit.config.algorithm import AlgorithmConfig, OptimConfig
from grpokit.config.base import _Section, check_failed
from grpokit.config.model_data import DataConfig, ModelConfig
from grpokit.config.monitor import MonitorConfig
from grpokit.config.rewards import CrossCheckConfig, RewardSpecConfig
from grpokit.config.rollout import RolloutConfig
from grpokit.config.train import EvalConfig, GuardConfig, LoraSection, TrainConfig
from grpokit.monitor.health import HealthConfig


class Config(_Section):
    model: ModelConfig = ModelConfig()
    """The policy model."""
    data: DataConfig = DataConfig()
    """Prompts."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantages, loss and KL."""
    rewards: list[RewardSpecConfig] = Field(default_factory=lambda: [RewardSpecConfig(name="math_accuracy")])
    """Reward functions, summed with their weights. The first one decides pass / fail."""
    crosscheck: CrossCheckConfig | None = None
    """A second, independent checker on a fraction of samples; disagreements go to
    RUN_DIR/disagreements.jsonl and `reward/checker_disagreement`."""
    optim: OptimConfig = OptimConfig()
    """Optimizer."""
    train: TrainConfig = TrainConfig()
    """Loop, checkpoints, logging."""
    eval: EvalConfig = EvalConfig()
    """The held-out checker: what scores `eval/pass@1` (grpokit.rewards.checker)."""
    health: HealthConfig = HealthConfig()
    """Health alarms (grpokit.monitor.health): per-alarm thresholds and action warn / stop / off."""
    guard: GuardConfig = GuardConfig()
    """Non-finite guard, rollback and reference integrity."""
    lora: LoraSection = LoraSection()
    """LoRA / QLoRA adapters (grpokit.models.lora)."""
    monitor: MonitorConfig = MonitorConfig()
    """Metric sinks: JSONL, TensorBoard, W&B, MLflow (grpokit.monitor.sinks)."""

    @field_validator("rewards")
    @classmethod
    def _some_rewards(cls, value):
        if not value:
            raise check_failed("rewards: at least one reward function is needed")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        self._fold_train_tensorboard()
        check_config(self)
        return self

    def _fold_train_tensorboard(self) -> None:
        """The deprecated `train.tensorboard` becomes `monitor.sinks`."""
        tb = self.train.tensorboard
        if tb is None:
            return
        warnings.warn("train.tensorboard is deprecated; use monitor.sinks (e.g. monitor.sinks=[jsonl,tensorboard])",
                      FutureWarning, stacklevel=2)
        sinks = self.monitor.sinks
        if not tb:
            if sinks is not None and "tensorboard" in sinks:
                raise ValueError("train.tensorboard=false contradicts monitor.sinks, which lists tensorboard "
                                 "(train.tensorboard is deprecated: drop it)")
            self.monitor.sinks = sinks if sinks is not None else ["jsonl"]
        elif sinks is not None and "tensorboard" not in sinks:
            self.monitor.sinks = sinks + ["tensorboard"]
        self.train.tensorboard = None

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.batch_size // self.rollout.group_size


def check_config(cfg: Config) -> None:
    """The checks that span sections, each section's `check_config(cfg)` in turn (a section's own
    fields are checked by its validators when it is built; `Config` runs this after its sections)."""
    for section in (cfg.rollout, cfg.crosscheck, cfg.algorithm):
        if section is not None:
            section.check_config(cfg)
