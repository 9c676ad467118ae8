"""Config section `rollout` (with its `rollout.vllm`): the generation engine and sampling."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpokit.config.base import EngineName, _Section, check_failed
from grpokit.errors import ConfigError


class VLLMConfig(_Section):
    """The in-process vLLM engine (`rollout.engine: vllm`, grpokit.rollout.vllm; docs/rollout.md)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype inside vLLM; `auto` is the policy's own dtype (for an engine built over a model
    directory: float32 on CPU, bfloat16 on CUDA, as `model.dtype: auto`)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion vLLM holds; None = the model's `max_position_embeddings`."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of the device's memory vLLM may take (weights + KV cache), shared with training when
    colocated (on CPU: the fraction of host memory). Ignored when `kv_cache_memory_bytes` is set."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """KV cache size in bytes, instead of sizing it from `gpu_memory_utilization`."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices one vLLM engine shards the model over."""
    enable_sleep_mode: bool = False
    """Free vLLM's device memory between rollouts (`release_memory` / `resume_memory` around each
    one; CUDA only, ignored with a log line elsewhere)."""
    sleep_level: Literal[1, 2] = 1
    """1: weights are moved to host memory while asleep and the KV cache dropped; 2: both dropped
    (less host memory; the weights pushed after the next optimizer step refill them)."""
    enforce_eager: bool = False
    """No CUDA graphs / torch.compile: faster start, slower decoding."""
    engine_kwargs: dict[str, Any] = {}
    """Further keyword arguments for `vllm.LLM` (e.g. `max_num_seqs`, `enable_prefix_caching`)."""


class AgentConfig(_Section):
    """Multi-turn episodes (`rollout.env` or `rollout.tools`; grpokit.rollout.episodes, docs/agents.md).
    An episode's token budget over all its turns and observations is `rollout.max_new_tokens`."""

    max_turns: int = Field(8, ge=1)
    """Assistant turns per episode; an episode still calling tools after them stops (`max_turns`)."""
    max_observation_tokens: int = Field(256, ge=8)
    """An observation (a tool's answer) longer than this is cut in the middle."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Longest wait for one tool call (or one `step`); a slower one is an error observation."""
    tool_workers: int = Field(4, ge=1)
    """Tool calls that run at once (threads off the decoding loop)."""
    scheduling: Literal["batched", "per_episode"] = "batched"
    """`batched`: each engine call takes every live episode's next turn, once all of the previous
    turn's tool calls have answered. `per_episode`: an episode's next turn joins the first engine
    call after its own tools answer, so a slow tool holds up its own episode only (docs/agents.md
    has the measurements: batched is faster unless tool latency is large and uneven)."""
    loop: str | None = None
    """An agent loop you own instead of an environment: `package.module:function` (or
    `path/to/file.py:function`) called as `fn(engine, row)` per episode, returning a
    `grpokit.rollout.episodes.Trajectory` (token ids, loss mask, sampler log-probs) or a list of
    them (segments of one episode); `tool_timeout_s` bounds its time between two generate calls
    (grpokit.rollout.episodes.custom, docs/agents.md)."""
    openai: str | None = None
    """Agent code written for the OpenAI API: `package.module:function`, an `async def run(client,
    row)` called once per episode with an `openai.AsyncOpenAI` client pointed at an
    OpenAI-compatible endpoint over the policy (grpokit.rollout.episodes.gateway, docs/agents.md);
    `rollout.agent: module:function` is short for it. Needs `grpokit[agents]`."""
    segments: Literal["auto", "whole", "per_turn"] = "auto"
    """How an episode is trained: `whole`, one sequence (the sampled turns with the template's
    observation tokens between them, masked); `per_turn`, one sample per assistant turn with the
    prompt the template gave it, all sharing the episode's advantage; `auto`, `whole` unless the
    chat template rewrites earlier turns (not prefix-preserving), then `per_turn`, said at start."""


class RolloutConfig(_Section):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    engine: EngineName = "hf"
    """Generation engine, a name in `grpokit.rollout.ENGINES` (`hf`: the policy itself through
    transformers with a KV cache, in-process; `hf_copy`: the same over its own copy of the
    weights, synced after every optimizer step; `vllm`: vLLM in this process, options in
    `rollout.vllm`; `server`: a `grpokit rollout-server` process at
    `rollout.server`; add one with `grpokit.rollout.register_engine`). docs/rollout.md compares them."""
    server: str | list[str] | None = None
    """`rollout.engine: server`: HOST:PORT of a running `grpokit rollout-server`, or a list of them:
    generation is spread over the servers by their measured speed, a server that fails is dropped
    (its prompts go to the others) and taken back with the current weights once it answers again
    (docs/rollout.md, "Several servers")."""
    server_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one rollout-server request (a generation, a weight update) and for its
    weight group to form."""
    server_api_key_env: str = Field("GRPOKIT_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the rollout server's API key (sent as `Authorization:
    Bearer KEY`; unset or empty: none sent). The key itself is never a config value: config files
    are copied into run directories and checkpoints."""
    server_retries: int = Field(3, ge=1)
    """Tries of a rollout-server request that gets no answer before the run stops with an error (its
    last checkpoint intact; `--resume` with a restarted server continues)."""
    sync_bucket_mb: float = Field(512.0, ge=0)
    """Weights go to a rollout server in parts of about this many MiB, each announced and broadcast
    as the trainer produces it (a sharded trainer gathers one tensor at a time), so the trainer
    never holds more than one part beyond its own weights. 0: the whole model in one part (a
    `--backend vllm` server takes only that). Logged per sync: `time/sync`, `sync/mb`, `sync/parts`."""
    sync_adapters: bool = True
    """With LoRA, send a rollout server the adapters alone after each step (its HF backend folds
    them into the base weights, sent once, first: docs/rollout.md, "LoRA runs send adapters") rather
    than the merged model. False, or a server that cannot (`--backend vllm`): the merged model."""
    async_: bool = Field(False, alias="async")
    """`rollout.async`: one-step-off-policy overlap. The engine generates the next batch with the
    current weights while the trainer updates on this one, so every batch after the first is one
    step stale (`rollout/staleness`), corrected by the importance weights of `is_correction`.
    Needs an engine that generates in the background (`server`). Off: every batch comes from
    the latest weights."""
    is_correction: bool = True
    """When the engine holds its own weights (its numerics may differ from the trainer's): weight
    each token's loss by the truncated importance ratio pi_old / pi_sampler (docs/algorithms.md,
    "Sampler/trainer mismatch"). pi_old is recomputed by the trainer either way."""
    is_cap: float = Field(2.0, gt=0)
    """Truncation C of the importance weights min(pi_old / pi_sampler, C)."""
    group_size: int = 16
    """G: completions sampled per prompt."""
    batch_size: int = Field(64, ge=1)
    """Completions per step (prompts per step = batch_size / group_size)."""
    temperature: float = Field(0.8, gt=0)
    """Sampling temperature. Log-probs for the loss use logits / temperature, like the sampler."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1 = off)."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens (0 = off)."""
    max_new_tokens: int = 2048
    """Longest completion in tokens; longer ones are cut and marked `finish_reason=length`."""
    ignore_eos: bool = False
    """Keep sampling after an EOS token (every completion is `max_new_tokens` long, finish_reason
    `length`); for benchmarks that need the same token count every step."""
    resample_threshold: float | None = Field(None, gt=0, lt=1)
    """Over-confidence resampling (practitioner's rule "DAPO as practised"): when the top token's
    probability exceeds this, sample from the distribution with that token excluded. None = off."""
    @field_validator("server")
    @classmethod
    def _address(cls, value):
        if value is not None:
            from grpokit.rollout.client import parse_address
            addresses = value if isinstance(value, list) else [value]
            if not addresses:
                raise ValueError("an empty list: give HOST:PORT of at least one rollout server")
            for a in addresses:
                try:
                    parse_address(a)
                except ConfigError as exc:
                    raise ValueError(str(exc).removeprefix("rollout.server ")) from None
            if len(set(addresses)) != len(addresses):
                raise ValueError(f"a server is listed twice: {addresses}")
        return value

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and refill the batch with
    fresh prompts, up to `max_sampling_rounds` generation rounds."""
    dynamic_sampling_on: Literal["reward", "pass"] = "reward"
    """What a group kept by dynamic sampling must vary in: `reward`, the total reward (a group whose
    answers differ only in a shaping term, e.g. a format reward, is kept); `pass`, whether each
    completion passes the first reward at `algorithm.pass_threshold` (DAPO's Eq. 11, 0 < #correct
    < G): only groups holding both right and wrong answers train."""
    max_sampling_rounds: int = Field(3, ge=1)
    """Generation rounds per step with dynamic sampling (the batch may stay short after them); a step
    draws at most this many times the prompts per step."""
    dynamic_width: Literal["keep_rate", "fixed"] = "keep_rate"
    """How many prompts a dynamic-sampling round draws. `keep_rate`: enough that the round keeps all
    the groups still missing with probability `dynamic_confidence`, at the share of groups kept so
    far in the run, so a step is mostly one wide generation rather than several thin ones; kept
    groups beyond the batch are dropped (`dynamic/surplus_groups`). `fixed`: the prompts per step
    every round (DAPO's procedure as written). Either way a step draws at most
    `max_sampling_rounds` times the prompts per step (docs/variants.md, "Dynamic sampling")."""
    dynamic_confidence: float = Field(0.9, gt=0, lt=1)
    """`dynamic_width: keep_rate`: the chance, at the measured keep rate, that a round keeps every
    group still missing (higher: fewer second rounds, more groups sampled and dropped)."""
    vllm: VLLMConfig = VLLMConfig()
    """Options of the `vllm` engine."""
    env: str | None = None
    """Multi-turn episodes with an environment: `package.module:Class` (or `path/to/file.py:Class`),
    built per episode, reset with the dataset row; its public methods are its tools (docs/agents.md)."""
    tools: list[str] = []
    """Multi-turn episodes with plain tool functions: `package.module:function` (or
    `path/to/file.py:function`) each."""
    agent: AgentConfig = AgentConfig()
    """Limits of multi-turn episodes (`rollout.env` / `rollout.tools`), or an agent loop of your own
    (`loop`), or agent code for the OpenAI API (`openai`; a string here is short for it)."""

    @field_validator("agent", mode="before")
    @classmethod
    def _agent_shorthand(cls, v):
        return {"openai": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _combinations(self):
        if self.group_size < 2:
            raise check_failed("rollout.group_size must be >= 2 (group-relative advantages need a group)")
        if self.batch_size % self.group_size:
            raise check_failed(f"rollout.batch_size ({self.batch_size}) must be divisible by rollout.group_size "
                               f"({self.group_size})")
        if self.engine == "server" and not self.server:
            raise check_failed("rollout.engine=server needs rollout.server=HOST:PORT "
                               "(a running `grpokit rollout-server`)")
        if self.max_new_tokens <= 0:
            raise check_failed("rollout.max_new_tokens must be > 0")
        if self.engine == "vllm" and self.resample_threshold is not None:
            raise check_failed("rollout.resample_threshold is not supported by rollout.engine=vllm "
                               "(vLLM cannot exclude the over-confident token); use engine hf or hf_copy")
        return self

    @property
    def episodes(self) -> bool:
        """True when rollouts are multi-turn episodes."""
        return bool(self.env or self.tools or self.agent.loop or self.agent.openai)

    def check_config(self, cfg) -> None:
        if self.batch_size % cfg.algorithm.mini_batches:
            raise check_failed("rollout.batch_size must be divisible by algorithm.mini_batches")
        if self.episodes:
            if self.env and self.tools:
                raise check_failed("give rollout.env or rollout.tools, not both (an environment's tools are its methods)")
            if self.agent.openai and (self.env or self.tools or self.agent.loop):
                raise check_failed("rollout.agent.openai runs your OpenAI-API agent code as the episodes: give it "
                                   "alone, not with rollout.env / rollout.tools / rollout.agent.loop")
            if self.agent.loop and (self.env or self.tools):
                raise check_failed("rollout.agent.loop plays its own episodes: give it or rollout.env / rollout.tools, "
                                   "not both")
            if cfg.algorithm.rewrite.enabled:
                raise check_failed("algorithm.rewrite is for single-turn completions, not multi-turn episodes")
