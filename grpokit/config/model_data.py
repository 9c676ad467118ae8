"""Config sections `model` and `data` (with its `data.curriculum`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpokit._names import did_you_mean
from grpokit.config.base import _Section, check_failed


class ModelConfig(_Section):
    path: str = "tiny"
    """Local Hugging Face causal-LM directory, or a `.gguf` file (converted once into a plain directory
    cached under `$GRPOKIT_CACHE/gguf`). Nothing is ever downloaded: a missing path is an error."""
    gguf_file: str = ""
    """A GGUF file name inside the directory `path` (the alternative to `path` naming the file)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; `auto` is float32 on CPU and bfloat16 on a CUDA GPU."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu` or `cuda[:N]`."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?|mps|xpu(:\d+)?", value):
            raise ValueError(f"unknown device {value!r}{did_you_mean(value, ['auto', 'cpu', 'cuda', 'mps', 'xpu'])} "
                             f"(use auto, cpu, cuda or cuda:N)")
        return value
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, about 30% more compute)."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory."""


class CurriculumConfig(_Section):
    enabled: bool = False
    """Curriculum sampling (grpokit.data.curriculum): a bar on prompt difficulty that rises as the
    policy improves, medium prompts first under it."""
    bar: Literal["pass_rate", "steps"] = "pass_rate"
    """What lifts the bar: `pass_rate`, the running pass rate (from `start` while it is below
    `rise_from` to `end` when it reaches `rise_to`; the bar never falls; prompts passed about half
    the time first); `steps`, a linear ramp over `ramp_steps` (easiest first)."""
    start: float = Field(0.3, ge=0, le=1)
    """The bar at step 0: the most difficult prompt admitted (difficulty = 1 - pass rate)."""
    end: float = Field(1.0, ge=0, le=1)
    """The bar at its highest."""
    rise_from: float = Field(0.5, ge=0, le=1)
    """`pass_rate` bar: the running pass rate at which the bar starts to rise."""
    rise_to: float = Field(0.9, ge=0, le=1)
    """`pass_rate` bar: the running pass rate at which it reaches `end`."""
    running_ema: float = Field(0.2, gt=0, le=1)
    """`pass_rate` bar: weight of each step's pass rate in the running pass rate."""
    ramp_steps: int = Field(100, ge=1)
    """`steps` bar: steps over which the bar rises linearly."""

    @model_validator(mode="after")
    def _rise(self):
        if self.bar == "pass_rate" and self.rise_from >= self.rise_to:
            raise check_failed(f"data.curriculum.rise_from ({self.rise_from:g}) must be below rise_to ({self.rise_to:g})")
        # a ramp length other than the default means a config written for the old step ramp (a saved
        # config.yaml holds every field, the default one included, and must load as it was saved)
        if self.bar == "pass_rate" and self.ramp_steps != type(self).model_fields["ramp_steps"].default:
            raise check_failed("data.curriculum.ramp_steps is the step ramp's (bar: steps); the bar is lifted by the "
                               "running pass rate by default: set data.curriculum.bar: steps to keep the ramp")
        if self.start > self.end:
            raise check_failed(f"data.curriculum.start ({self.start:g}) is above end ({self.end:g})")
        return self
    pool_factor: int = Field(4, ge=1)
    """Candidates considered per prompt drawn."""
    ema: float = Field(0.5, gt=0, le=1)
    """Weight of the newest pass rate in a prompt's difficulty estimate."""
    prior_field: str = "difficulty"
    """Dataset column holding a prior difficulty in [0, 1] for unseen prompts."""
    prior: float = Field(0.5, ge=0, le=1)
    """Difficulty of an unseen prompt without that column."""


class DataConfig(_Section):
    path: str = ""
    """Prompt dataset: a .jsonl / .parquet file or a `datasets` dataset saved on disk."""
    eval_path: str = ""
    """Held-out prompts for `eval/pass@1` (same format). Empty: a held-out split is carved from
    `data.path` (`eval_split`), and said so at start."""
    eval_split: float = Field(0.05, ge=0, lt=1)
    """With no `eval_path`: hold this fraction of the distinct training prompts out for held-out
    evaluation (seeded by `train.seed`; at least 20 prompts, at most `eval_split_max`; the training
    data loses them). The reward-hacking alarm needs held-out prompts (docs/metrics.md). Data
    too small to spare them (fewer than 100 distinct prompts) trains whole, with a warning.
    0 = no split (no evaluation without `eval_path`)."""
    eval_split_max: int = Field(100, ge=20)
    """Most prompts a carved held-out split holds (evaluation stays cheap on large datasets)."""
    prompt_field: str = "prompt"
    """Column holding the prompt (a string, or a list of chat messages)."""
    answer_field: str = "answer"
    """Column holding the reference answer; passed to rewards as `answer`."""
    chat_template: Literal["auto", "never", "always"] = "auto"
    """Apply the tokenizer's chat template: `auto` does so for conversational prompts when the
    tokenizer has one."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded)."""
    eval_size: int = Field(0, ge=0)
    """Evaluate on at most this many held-out prompts (0 = all)."""
    curriculum: CurriculumConfig = CurriculumConfig()
    """Curriculum sampling by tracked pass rate."""
