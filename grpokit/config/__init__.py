"""Typed configuration: YAML files, presets, `key.sub=value` overrides, one docstring per field.

Defaults follow the practitioner's starting values (G 16, temperature 0.8, epsilon 0.2, beta 0.02
with the adaptive controller, lr 3e-6 for full fine-tuning, 2048 new tokens; docs/training.md,
"Practitioner's rules"); where a default differs, docs/algorithms.md and docs/metrics.md say why.
A preset is a small YAML file that sets only what differs; `base:` in a YAML file names another
file or preset it extends.

Every error a user can make here raises `ConfigError` with one line naming the key; the CLI prints
it and exits with code 2.

One module per group of sections: base (the `_Section` base, registered-name fields),
model_data (`model`, `data`), rollout, algorithm (`algorithm`, `optim`), rewards (`rewards`,
`crosscheck`), train (`train`, `lora`, `guard`), monitor, root (`Config`, `check_config`) and
loading (YAML, presets, overrides, `load_config`). A check of one section's fields is a validator
of that section; a check spanning sections is that section's `check_config(cfg)` method, all run
by `check_config` once the sections are built.
"""

from grpokit.config.algorithm import AlgorithmConfig, FilterConfig, KLConfig, OptimConfig, RewriteConfig
from grpokit.config.base import (
    AdvantageName, AggregationName, ControllerName, EngineName, KLKindName, RewardName, check_failed,
)
from grpokit.config.base import _registered, _Section  # noqa: F401 - for callers of the former module
from grpokit.config.loading import (
    PRESET_DIR, config_from_dict, dump_config, load_config, parse_override, read_configs, resolve_preset, set_key,
)
from grpokit.config.loading import _deep_merge, _format_error, _read_yaml, _suggest, _valid_keys  # noqa: F401
from grpokit.config.model_data import CurriculumConfig, DataConfig, ModelConfig
from grpokit.config.monitor import MonitorConfig
from grpokit.config.rewards import CrossCheckConfig, RewardSpecConfig
from grpokit.config.rollout import RolloutConfig, VLLMConfig
from grpokit.config.root import Config, check_config
from grpokit.config.train import EvalConfig, GuardConfig, LoraSection, TrainConfig
from grpokit.errors import ConfigError
from grpokit.monitor.health import HealthConfig

__all__ = [
    "PRESET_DIR", "AdvantageName", "AggregationName", "AlgorithmConfig", "Config", "ConfigError", "ControllerName",
    "CrossCheckConfig", "CurriculumConfig", "DataConfig", "EngineName", "FilterConfig", "GuardConfig",
    "HealthConfig", "KLConfig", "KLKindName", "LoraSection", "ModelConfig", "MonitorConfig", "OptimConfig",
    "EvalConfig", "RewardName", "RewardSpecConfig", "RewriteConfig", "RolloutConfig", "TrainConfig", "VLLMConfig",
    "check_config", "check_failed", "config_from_dict", "dump_config", "load_config", "parse_override",
    "read_configs", "resolve_preset", "set_key",
]
