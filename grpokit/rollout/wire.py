"""What travels over HTTP between the trainer and a rollout server (`grpokit rollout-server`).

JSON bodies, checked on arrival with pydantic: a malformed request is refused by the server (HTTP
400, one line naming the field) and a malformed response by the client. Tensors never travel here:
weight updates announce their names, shapes and dtypes over HTTP and the tensors themselves go over
the weight group (grpokit.rollout.weight_sync).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from grpokit.rollout.base import SamplingParams

# dtypes a weight update may carry, by their wire name
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WireError(ValueError):
    """A body that does not follow the protocol; the message is one line."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class WireSampling(_Wire):
    """`grpokit.rollout.base.SamplingParams` on the wire."""
    n: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, lt=2**31)
    resample_threshold: float | None = Field(None, gt=0, lt=1)
    ignore_eos: bool = False

    def params(self) -> SamplingParams:
        return SamplingParams(**self.model_dump())


class GenerateRequest(_Wire):
    prompt_ids: list[list[int]] = Field(min_length=1)
    params: WireSampling
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Seeds the server's sampler, so the trainer's seeded run stays reproducible."""
    stream_seeds: list[int] | None = None
    """One seed per prompt instead of `seed`: prompt j's completions draw from a stream of their own
    (`grpokit.rollout.base.PromptStreams`), whatever else shares the request. What a data-parallel
    trainer sends, so that a group samples the same completions at any world size."""

    @model_validator(mode="after")
    def _prompts(self):
        if self.stream_seeds is not None:
            if self.seed is not None:
                raise ValueError("seed and stream_seeds: give one of them")
            if len(self.stream_seeds) != len(self.prompt_ids):
                raise ValueError(f"{len(self.stream_seeds)} stream_seeds for {len(self.prompt_ids)} prompts")
            if any(not 0 <= s < 2**63 for s in self.stream_seeds):
                raise ValueError("a stream seed is outside [0, 2^63)")
        for i, p in enumerate(self.prompt_ids):
            if not p:
                raise ValueError(f"prompt {i} is empty (every prompt needs at least one token)")
            if min(p) < 0:
                raise ValueError(f"prompt {i} has a negative token id")
        return self


class GenerateResponse(_Wire):
    """N = prompts x n completions, group after group; each row unpadded."""
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    """Per token, the log-prob of the distribution sampled from (finite, <= 0)."""
    finish_reason: list[Literal["eos", "length"]]
    resampled: int = Field(0, ge=0)
    weights_version: int
    """The version of the weights that generated these completions."""

    @model_validator(mode="after")
    def _shapes(self):
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.finish_reason) != n:
            raise ValueError(f"{n} completions but {len(self.logprobs)} log-prob rows and "
                             f"{len(self.finish_reason)} finish reasons")
        for i, (ids, lp) in enumerate(zip(self.completion_ids, self.logprobs)):
            if len(ids) != len(lp) or not ids:
                raise ValueError(f"completion {i}: {len(ids)} tokens but {len(lp)} log-probs")
            if min(ids) < 0:
                raise ValueError(f"completion {i} has a negative token id")
            if not all(-float("inf") < x <= 1e-4 for x in lp):      # a log-prob; a hair above 0 is rounding
                raise ValueError(f"completion {i} has a log-prob that is not finite and <= 0")
        return self


class TensorMeta(_Wire):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[int] = Field(max_length=8)

    @model_validator(mode="after")
    def _known(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)})")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"{self.name}: negative size in shape {self.shape}")
        if math.prod(self.shape) >= 2**40:
            raise ValueError(f"{self.name}: shape {self.shape} is over 2^40 elements")
        return self


class AdapterMeta(_Wire):
    """One adapted layer of an adapter update (grpokit.rollout.adapters)."""
    scale: float
    fan_in_fan_out: bool = False
    fp32: bool = False


class UpdateRequest(_Wire):
    """Announces a weight update, or one part of it: the tensors follow over the weight group, in
    this order. An update in parts (buckets, so that the trainer never holds the whole model at
    once) numbers them from 0; the version is loaded when the part marked `last` has arrived and
    the parts together gave every parameter."""
    version: int = Field(ge=0, lt=2**62)
    tensors: list[TensorMeta] = Field(min_length=1, max_length=100_000)
    part: int = Field(0, ge=0, lt=2**31)
    last: bool = True
    base: bool = False
    """The parts carry a LoRA run's base weights, which later adapter updates are folded into
    (grpokit.rollout.adapters); its last part may be the adapters."""
    adapters: dict[str, AdapterMeta] | None = Field(None, min_length=1)
    """The tensors are LoRA adapters (NAME.lora_A, NAME.lora_B per adapted layer NAME), folded into
    the base weights: a whole update, or the last part of a base update."""

    @model_validator(mode="after")
    def _unique(self):
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {dup!r} is announced twice")
        if self.adapters is not None and not self.last:
            raise ValueError("adapters come as a whole update or as the last part of a base update")
        if self.adapters is not None and self.part > 0 and not self.base:
            raise ValueError("adapters in a later part end a base update (base: true)")
        return self


class GroupRequest(_Wire):
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(gt=0, le=86_400)


def parse(model: type[BaseModel], body, what: str):
    """`model` from a decoded JSON body, or a one-line WireError naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        raise WireError(f"malformed {what}: {loc}: {e['msg'].removeprefix('Value error, ')}") from None


def describe(named_tensors: list[tuple[str, torch.Tensor]]) -> list[dict]:
    """Wire metadata of (name, tensor) pairs; an unsupported dtype is a WireError."""
    out = []
    for name, t in named_tensors:
        if t.dtype not in DTYPE_NAMES:
            raise WireError(f"{name}: dtype {t.dtype} cannot be sent to a rollout server")
        out.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
    return out
