"""`grpokit.GRPO`: the trainer as one object, for use from Python.

    import grpokit

    def correct(prompts, completions, answer, **columns):     # one score per completion
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    grpo = grpokit.GRPO(model="./my-qwen", rewards=[correct, ("numeric_match", 0.5)],
                        dataset="prompts.jsonl", config="grpo", overrides={"train.steps": 100})
    metrics = grpo.train()

It is `grpokit train` with Python objects in place of files and names:

- `model`: a local model directory, or a loaded transformers model (then `tokenizer=`, or the
  tokenizer saved in the model's own directory).
- `rewards`: a list of reward functions, registered reward names, `(function or name, weight)` pairs
  or spec dicts (`{"name": ..., "weight": ..., "args": {...}}`). The first decides pass / fail. A
  function is called as `fn(prompts=..., completions=..., **columns)` when it has a parameter named
  `completions` (TRL's convention: `def f(completions, **kwargs)`), else as
  `fn(prompts, completions, **columns)` (grpokit's); it gets only the columns it names unless it
  takes `**kwargs`. It is registered under its own name (`name_2`, ... on a clash) only while the
  trainer is built, so its metrics are `reward/<name>/...` and the global registry is left as it was.
- `dataset` / `eval_dataset`: a list of dicts, a JSONL / JSON / Parquet path, a saved `datasets`
  directory or a `datasets.Dataset`; rows need `prompt` (`data.prompt_field`), usually `answer`;
  every other column reaches the rewards.
- `config`: a `Config`, a dict, a preset name or a YAML path (or a list of them, merged left to
  right); `overrides`: dotted keys, e.g. `{"train.steps": 5, "rollout.group_size": 8}`, applied last.

Bad input is a one-line `ConfigError` / `DataError` (both `ValueError`s) when the object is built.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

from grpokit.config import Config, ConfigError, config_from_dict, read_configs, set_key
from grpokit.data.datasets import DataError, PromptDataset, load_prompts, prompts_from_rows
from grpokit.rewards import REGISTRY, get
from grpokit.rewards.registry import registered_while
from grpokit.rewards.user import adapt as _adapt, check_columns, reward_name as _reward_name

__all__ = ["GRPO"]


class GRPO:
    """GRPO-family training from Python objects (see the module docstring). Building it loads the
    model and the prompts and checks everything; `train()` runs, `evaluate()` scores held-out prompts.

    Attributes: `config` (the validated `Config`), `trainer` (the `grpokit.train.run.Trainer`),
    `reward_names` (the names the rewards are logged under, in order).
    """

    def __init__(self, model: Any = None, rewards: Any = None, dataset: Any = None, config: Any = None, *,
                 eval_dataset: Any = None, tokenizer: Any = None, overrides: Mapping[str, Any] | None = None,
                 env: Any = None, tools: list | None = None, agent_loop: Any = None):
        """`env`: an environment class (multi-turn episodes: built per episode, its public methods
        are its tools), `tools`: plain tool functions, or `agent_loop`: a function
        `fn(engine, row) -> Trajectory` that plays its own episodes; docs/agents.md."""
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ConfigError(f"overrides must be a dict of dotted keys, e.g. {{'train.steps': 5}}; "
                              f"got {type(overrides).__name__}")
        data = _config_data(config)
        loaded = None
        if isinstance(model, (str, os.PathLike)):
            set_key(data, ["model", "path"], os.fspath(model), "model")
        elif model is not None:
            if not hasattr(model, "parameters"):
                raise ConfigError(f"model must be a model directory or a loaded transformers model, "
                                  f"got {type(model).__name__}")
            loaded, where = model, _model_dir(model)
            if where:
                set_key(data, ["model", "path"], where, "model")
        if isinstance(dataset, (str, os.PathLike)):          # recorded in the run's config.yaml
            set_key(data, ["data", "path"], os.fspath(dataset), "dataset")
        if isinstance(eval_dataset, (str, os.PathLike)):
            set_key(data, ["data", "eval_path"], os.fspath(eval_dataset), "eval_dataset")
        env_spec = None
        if agent_loop is not None:
            if env is not None or tools:
                raise ConfigError("give agent_loop or env / tools, not both (the loop plays its own episodes)")
            if not callable(agent_loop):
                raise ConfigError(f"agent_loop must be a function, got {type(agent_loop).__name__}")
            env_spec = agent_loop
            set_key(data, ["rollout", "agent", "loop"], _where(agent_loop), "agent_loop")
        elif env is not None or tools:
            from grpokit.rollout.episodes import EnvSpec
            env_spec = EnvSpec(env, list(tools) if tools else None)
            if env is not None:
                set_key(data, ["rollout", "env"], _where(env), "env")
            else:
                set_key(data, ["rollout", "tools"], [_where(t) for t in tools], "tools")
        specs, fns = _reward_specs(rewards) if rewards is not None else (None, [])
        # the callables are in the registry only while the config is checked and the trainer built
        with registered_while(fns) as names:
            if specs is not None:
                for spec, name in zip((s for s in specs if callable(s["name"])), names):
                    spec["name"] = name
                data["rewards"] = specs
            for key, value in (overrides or {}).items():
                set_key(data, str(key).split("."), value, f"overrides[{key!r}]")
            self.config: Config = config_from_dict(data)
            self._reward_fns = {s.name: get(s.name) for s in self.config.rewards}
            d = self.config.data
            if dataset is None and not d.path:
                raise DataError("no prompts: pass dataset= (rows, a JSONL / Parquet path or a datasets.Dataset) "
                                "or set data.path")
            train_ds = self._prompts(dataset if dataset is not None else d.path, "dataset")
            held = eval_dataset if eval_dataset is not None else (d.eval_path or None)
            eval_ds = self._prompts(held, "eval_dataset") if held is not None else None
            if loaded is not None and tokenizer is None:
                tokenizer = _tokenizer_of(loaded, self.config)
            from grpokit.train import build_run

            self.trainer = build_run(self.config, model=loaded, tokenizer=tokenizer, dataset=train_ds,
                                     eval_dataset=eval_ds, env=env_spec)
        self.reward_names = [s.name for s in self.config.rewards]

    # ------------------------------------------------------------------ running

    def train(self, *, resume: bool = False) -> dict[str, float]:
        """Train for `train.steps` steps (from the last checkpoint of `train.run_dir` with
        `resume=True`); returns the last step's metrics (held-out ones included when evaluated)."""
        return self.trainer.train(resume=resume)

    def evaluate(self, dataset: Any = None) -> dict[str, float]:
        """Held-out metrics of the current policy (`eval/pass@1`, and `eval/mean@k` with
        `train.eval_samples`) on `dataset`, or on the `eval_dataset` / `data.eval_path` given."""
        held = self.trainer.eval_dataset
        if dataset is not None:
            held = self._prompts(dataset, "dataset")
            self._check_rewards(held, "dataset")
        if held is None:
            raise ConfigError("no held-out prompts: pass eval_dataset= to GRPO (or set data.eval_path), "
                              "or a dataset to evaluate()")
        before, self.trainer.eval_dataset = self.trainer.eval_dataset, held
        try:
            return self.trainer.run_eval()
        finally:
            self.trainer.eval_dataset = before

    # ------------------------------------------------------------------ inputs

    def _prompts(self, source, what: str):
        """A `PromptDataset` from a path, a `PromptDataset`, rows in memory or a `datasets.Dataset`."""
        d = self.config.data
        if isinstance(source, PromptDataset):
            return source
        if isinstance(source, (str, os.PathLike)):
            return load_prompts(source, prompt_field=d.prompt_field, answer_field=d.answer_field)
        hf = sys.modules.get("datasets")                    # only an object of a loaded `datasets`
        if hf is not None and isinstance(source, hf.DatasetDict):
            raise DataError(f"{what}: a DatasetDict holds several splits ({', '.join(source)}); pass one, "
                            f"e.g. {what}['train']")
        if isinstance(source, (Mapping, str, bytes)) or not hasattr(source, "__iter__"):
            raise DataError(f"{what} must be a list of rows (dicts), a JSONL / Parquet path or a "
                            f"datasets.Dataset, got {type(source).__name__}")
        return prompts_from_rows(list(source), source=what, prompt_field=d.prompt_field,
                                 answer_field=d.answer_field)

    def _check_rewards(self, prompts, what: str) -> None:
        """Every column a reward reads must be a column of `prompts` (or one the trainer passes)."""
        if prompts is not None:
            check_columns(self.config.rewards, prompts.rows, what, fns=self._reward_fns)


# ---------------------------------------------------------------------- config


def _config_data(config) -> dict:
    """The raw config mapping of a Config, dict, preset name, YAML path, or a list of names/paths."""
    if config is None:
        return {}
    if isinstance(config, Config):                          # only what was set: defaults derived
        return config.model_dump(exclude_unset=True)        # from other fields stay derived
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return read_configs(os.fspath(config))
    if isinstance(config, (list, tuple)) and all(isinstance(c, (str, os.PathLike)) for c in config):
        return read_configs([os.fspath(c) for c in config])
    raise ConfigError(f"config must be a Config, a dict, a preset name or a YAML path, got {type(config).__name__}")


# ---------------------------------------------------------------------- rewards


def _reward_specs(rewards) -> tuple[list[dict], list[tuple[str, Callable]]]:
    """Config reward specs for `rewards`, with each callable still in its spec's `name`, and the
    (preferred name, adapted function) pairs to register, in the order of those specs."""
    items = [rewards] if callable(rewards) or isinstance(rewards, (str, Mapping)) else rewards
    if isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], Real):
        items = [items]                                     # a single (reward, weight) pair
    try:
        items = list(items)
    except TypeError:
        raise ConfigError(f"rewards must be a list of reward functions or names, got {type(rewards).__name__}") from None
    specs, fns = [], []
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            spec = dict(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            reward, weight = item
            if isinstance(weight, bool) or not isinstance(weight, Real):
                raise ConfigError(f"rewards[{i}]: the weight of a (reward, weight) pair must be a number, "
                                  f"got {weight!r}")
            spec = {"name": reward, "weight": float(weight)}
        else:
            spec = {"name": item}
        reward = spec.get("name")
        if callable(reward):
            registered = getattr(reward, "reward_name", None)
            if registered is not None and REGISTRY.get(registered) is reward:
                spec["name"] = registered                   # a registered function: its name
            else:
                spec["name"] = _adapt(reward)
                fns.append((_reward_name(reward), spec["name"]))
        elif not isinstance(reward, str):
            raise ConfigError(f"rewards[{i}]: expected a reward function, a registered reward name, a "
                              f"(reward, weight) pair or a spec dict; got {type(reward).__name__} {reward!r}")
        specs.append(spec)
    return specs, fns


# ---------------------------------------------------------------------- model


def _where(obj) -> str:
    """"module:qualname" of a class or function, as recorded in the run's config.yaml."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


def _model_dir(model) -> str:
    """The local directory a loaded model came from, or ""."""
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(path) if path and os.path.isdir(str(path)) else ""


def _tokenizer_of(model, cfg: Config):
    where = _model_dir(model)
    if not where:
        raise ConfigError("tokenizer= is needed with a loaded model that has no local directory to load one from")
    from grpokit.models.hf import load_tokenizer

    return load_tokenizer(where, trust_remote_code=cfg.model.trust_remote_code)
