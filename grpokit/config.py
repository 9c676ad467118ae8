"""Typed configuration: YAML files, presets, `key.sub=value` overrides, one docstring per field.

Defaults follow the practitioner's starting values (G 16, temperature 0.8, epsilon 0.2, beta 0.02
with the adaptive controller, lr 3e-6 for full fine-tuning, 2048 new tokens; docs/training.md,
"Practitioner's rules"); where a default differs, docs/algorithms.md and docs/metrics.md say why.
A preset is a small YAML file that sets only what differs; `base:` in a YAML file names another
file or preset it extends.

Every error a user can make here raises `ConfigError` with one line naming the key; the CLI prints
it and exits with code 2.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grpokit._names import closest, did_you_mean, lookup
from grpokit.errors import ConfigError
from grpokit.monitor.health import HealthConfig
from grpokit.monitor.sinks import SINK_NAMES
from grpokit.rewards.compose import TimeoutS

PRESET_DIR = Path(__file__).parent / "presets"



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
    """Curriculum sampling (grpokit.data.curriculum): easier prompts first."""
    start: float = Field(0.3, ge=0, le=1)
    """Difficulty threshold at step 0 (difficulty = 1 - pass rate)."""
    end: float = Field(1.0, ge=0, le=1)
    """Difficulty threshold once the ramp is over."""
    ramp_steps: int = Field(100, ge=1)
    """Steps over which the threshold rises linearly."""
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
    """Held-out prompts for `eval/pass@1` (same format); empty disables evaluation."""
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


class RolloutConfig(_Section):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    engine: EngineName = "hf"
    """Generation engine, a name in `grpokit.rollout.ENGINES` (`hf`: the policy itself through
    transformers with a KV cache, in-process; `hf_copy`: the same over its own copy of the
    weights, synced after every optimizer step; `vllm`: vLLM in this process, options in
    `rollout.vllm`; `server`: a `grpokit rollout-server` process at
    `rollout.server`; add one with `grpokit.rollout.register_engine`). docs/rollout.md compares them."""
    server: str | None = None
    """`rollout.engine: server`: HOST:PORT of a running `grpokit rollout-server`."""
    server_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one rollout-server request (a generation, a weight update) and for its
    weight group to form."""
    server_retries: int = Field(3, ge=1)
    """Tries of a rollout-server request that gets no answer before the run stops with an error (its
    last checkpoint intact; `--resume` with a restarted server continues)."""
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
            try:
                parse_address(value)
            except ConfigError as exc:
                raise ValueError(str(exc).removeprefix("rollout.server ")) from None
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
    """Generation rounds per step with dynamic sampling (the batch may stay short after them)."""
    vllm: VLLMConfig = VLLMConfig()
    """Options of the `vllm` engine."""


class KLConfig(_Section):
    beta: float = Field(0.02, ge=0)
    """KL coefficient (initial value for adaptive controllers). 0 = no reference model."""
    estimator: KLKindName = "k3"
    """Per-token KL estimator, a name in `grpokit.algo.kl.KINDS`: k1, k2, k3, k3_is, or one added
    with `register_kind` (docs/algorithms.md says which gradient each gives)."""
    controller: ControllerName = "adaptive"
    """How beta changes during training, a name in `grpokit.algo.control.CONTROLLERS`: fixed,
    adaptive, ziegler, warmup, schedule, or one added with `register_controller`."""
    target_unit: Literal["sequence", "token"] = "sequence"
    """What the controller's KL target is measured in: `sequence`, the KL of a whole completion
    (Σ over its tokens, averaged over completions: `kl/ref_seq`), or `token`, the per-token mean
    (`kl/ref`). The practitioner's target of 1-10 only makes sense per completion: a per-token KL
    of 1 nat means the policy has left the reference entirely (docs/algorithms.md, "KL target")."""
    target_low: float = Field(1.0, ge=0)
    """Adaptive controller: lower beta when the observed KL (in `target_unit`) is below this."""
    target_high: float = Field(10.0, gt=0)
    """Adaptive controller: raise beta when the observed KL (in `target_unit`) is above this.
    Bigger models want a smaller target (the rule: "1~10, smaller for bigger models")."""

    @model_validator(mode="after")
    def _band(self):
        if self.target_low > self.target_high:
            raise ValueError(f"target_low {self.target_low:g} > target_high {self.target_high:g} "
                             f"(the band is in nats per {self.target_unit}: per completion by default)")
        return self
    adapt_factor: float = Field(1.05, gt=1)
    """Adaptive controller: beta is multiplied (divided) by this after each step whose KL is above
    (below) the band. PPO's band rule uses 2 per policy iteration; applied at every GRPO step, 1.5
    raised beta from 0.02 to its cap of 10 in 25 steps on the demo task and held-out accuracy
    collapsed from 68% to 16%, where 1.05 kept learning (docs/variants.md)."""
    controller_args: dict[str, Any] = {}
    """Extra arguments for the controller (see grpokit.algo.control)."""
    in_reward: bool = False
    """Put the (detached, k1) KL into the reward instead of the loss."""
    ref_dropout: float = Field(0.0, ge=0, lt=1)
    """Reference dropout (practitioner's rule "Dr. GRPO as practised"): dropout on the reference's
    hidden states when computing KL."""
    ref_device: Literal["same", "cpu", "swap"] = "same"
    """Where a separate reference copy lives (practitioner's rule "memory order"): `same` device as
    the policy; `cpu` (kept and run on the CPU); `swap` (kept on the CPU, moved to the policy's
    device for each reference pass). Ignored for LoRA, whose reference is the policy with its
    adapters off (no copy)."""
    ref_cache: int = Field(0, ge=0)
    """Cache up to this many per-sample reference log-prob vectors keyed by (prompt, completion)
    token ids, so repeated samples are not recomputed (practitioner's rule "LoRA-GRPO": pre-cached
    reference log-probs); 0 = off. Off when ref_dropout > 0."""


class FilterConfig(_Section):
    max_length: int | None = None
    """Drop completions longer than this many tokens from the loss."""
    drop_truncated: bool = False
    """Drop completions cut at max_new_tokens."""
    drop_duplicates: bool = False
    """Drop repeated identical completions within a group (the first is kept)."""
    format_reward: str | None = None
    """Drop samples scoring <= 0 on this reward function (a format check; one of `rewards`)."""
    drop_nonfinite: bool = True
    """Drop samples whose reward could not be computed."""


class RewriteConfig(_Section):
    enabled: bool = False
    """Wrong-answer rewriting (grpokit.data.rewrite): wrong completions become teaching sequences."""
    weight: float = Field(0.1, ge=0)
    """Weight of the auxiliary likelihood term on the rewritten note."""
    template: str = "\nThat is wrong: the verified answer differs. The answer is {answer}."
    """Note appended to a wrong completion; `{answer}` is the reference answer."""
    max_per_step: int = Field(16, ge=1)
    """Rewritten sequences per step at most."""


class AlgorithmConfig(_Section):
    advantage: AdvantageName = "grpo"
    """Advantage estimator, a name in `grpokit.algo.advantages.ESTIMATORS`: grpo, dr_grpo, rloo,
    sign, reinforce_pp_baseline, batch_std, opo, or one added with `register_estimator`."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
    length_buckets: list[float] | None = None
    """Length-bucketed baselines: bucket edges (tokens, or quantiles in (0,1) with bucket_mode)."""
    bucket_mode: Literal["tokens", "quantiles"] = "tokens"
    """Whether `length_buckets` are token counts or quantiles of each group's lengths."""
    loss_agg: AggregationName = "token_mean"
    """Loss aggregation, a name in `grpokit.algo.loss.AGGREGATIONS` (token_mean = DAPO,
    seq_mean_token_mean = GRPO paper, seq_mean_token_sum_norm = Dr. GRPO with max_new_tokens as the
    constant, or one added with `register_aggregation`)."""
    eps_low: float = Field(0.2, ge=0)
    """Lower clip range: ratio >= 1 - eps_low."""
    eps_high: float = Field(0.2, ge=0)
    """Upper clip range: ratio <= 1 + eps_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None = off)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """`sequence` = GSPO's length-normalised sequence ratio."""
    mu: int = Field(1, ge=1)
    """Policy updates (passes) per rollout batch. With mu = 1 and one mini-batch the old log-probs
    are the current ones, detached (no extra forward pass)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass: the rollout batch is split into this many mini-batches."""
    mask_truncated: bool = False
    """Overlong filtering (DAPO): truncated completions get no loss."""
    kl: KLConfig = KLConfig()
    """KL penalty to the frozen reference."""
    sample_filter: FilterConfig = FilterConfig()
    """Proxy-based sample filtering (practitioner's rule "Dr. GRPO as practised")."""
    rewrite: RewriteConfig = RewriteConfig()
    """Wrong-answer rewriting (practitioner's rule "Dr. GRPO as practised")."""
    pass_threshold: float = 1.0
    """A completion passes (for pass@1, curriculum and rewriting) when the first reward is >= this."""


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


class OptimConfig(_Section):
    lr: float = Field(3e-6, gt=0)
    """AdamW learning rate (starting values: 3e-6 full fine-tune, 1e-4 to 2e-4 LoRA)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward (gradient accumulation makes up the mini-batch)."""
    logprob_chunk: int = Field(1024, ge=1)
    """Tokens per chunk when computing log-probs from hidden states (bounds logits memory)."""


class TrainConfig(_Section):
    steps: int = Field(100, ge=1)
    """Rollout-and-update steps."""
    max_minutes: float = Field(0.0, ge=0)
    """Also stop after the step that ends this many minutes of training (0 = no time limit)."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    run_dir: str = "runs/grpo"
    """Where metrics, samples, checkpoints and the report go."""
    save_every: int = Field(500, ge=0)
    """Checkpoint every N steps (the practitioner's rule: every 500-1000 steps), plus step 0 and
    the end; 0 = no step-based checkpoints. A run that saves at all saves step 0 first: the NaN
    guard's rollback needs a healthy checkpoint to go back to."""
    save_every_minutes: float = Field(30.0, ge=0)
    """Also checkpoint when this many minutes have passed since the last checkpoint, whichever
    comes first (0 = off). With both 0 only the end of the run is saved."""
    keep_last: int = Field(2, ge=1)
    """Newest checkpoints kept (older ones are deleted, except the healthy ones below)."""
    check_rewards: bool = True
    """At the start of a fresh run, score a small probe batch twice (and once more after restarting
    the built-in checker processes) and warn, naming the function, when a reward's scores differ:
    rewards must be deterministic (docs/rewards.md, "Determinism check")."""
    batch_advice: bool = True
    """Warn at start when `rollout.batch_size` is far below the 512-2048 responses per step that
    give smooth curves (the practitioner's batch rule, docs/training.md); the demo turns it off."""
    keep_healthy: int = Field(1, ge=1)
    """Newest healthy checkpoints kept besides them (rollback targets)."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation (when `data.eval_path` is set) every N steps and after the last step;
    0 = only before the first step (logged as step 0) and after the last."""
    eval_samples: int = Field(0, ge=0)
    """Sampled completions per eval prompt for `eval/mean@k` (0 = greedy only)."""
    keep_best: bool = False
    """End the run with the policy of the best `eval/pass@1` on `data.eval_path` (evaluated before
    the first step, every `train.eval_every` steps and after the last; on a tie the later), not the
    last step's: early stopping on a validation split. The best policy is also written to
    RUN_DIR/best/ (a Hugging Face directory; `best.json` names its step and score); checkpoints keep
    the last policy, so `--resume` goes on from there. The split must be drawn like the training
    data and must not be the one you report: choosing by it biases its own score upwards. One
    process only."""
    sample_every: int = Field(10, ge=0)
    """Write completions to RUN_DIR/samples every N steps (0 = never)."""
    tensorboard: bool | None = None
    """Deprecated: use `monitor.sinks`. `false` drops TensorBoard (unset sinks become `[jsonl]`),
    `true` adds it to a `monitor.sinks` list; either way it is folded into `monitor.sinks` and
    reset to null."""
    progress: bool = True
    """Show a progress bar."""
    distributed: Literal["auto", "none", "ddp", "fsdp2"] = "auto"
    """Training on several processes (launched by `torchrun`, or `grpokit train --nproc N`;
    docs/distributed.md): `fsdp2` shards parameters, gradients and optimizer state over the ranks,
    `ddp` keeps a full copy on each; `auto` is fsdp2 when WORLD_SIZE > 1, else `none` (this process
    alone, torch.distributed never imported)."""
    dist_timeout_s: float = Field(300.0, gt=0)
    """Seconds a collective operation waits for the other ranks before failing (a dead rank then
    stops the job in bounded time instead of torch's 30-minute default)."""


class LoraSection(_Section):
    enabled: bool = False
    """Train LoRA adapters (peft) instead of all weights; the reference is then the same model with
    its adapters disabled (no second copy). Practitioner's rule "LoRA-GRPO": rank 16-32, lr 1e-4 to
    2e-4."""
    rank: int = Field(16, ge=1)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha; the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input. It acts only in train mode; the GRPO trainer keeps the policy
    in eval mode (sampling and training see one distribution), so it matters for SFT only."""
    target_modules: list[str] | str = "auto"
    """Modules that get adapters: `auto` (every attention and MLP projection, chosen per
    architecture in grpokit.train.lora.DEFAULT_TARGETS), `all-linear`, or a list of module names."""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4 bit through bitsandbytes (needs lora.enabled)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type (QLoRA paper: NF4)."""
    double_quant: bool = True
    """Quantize the 4-bit quantization constants too (QLoRA's double quantization)."""
    reference: Literal["adapter_off", "copy"] = "adapter_off"
    """The KL reference: the policy with its adapters disabled (no extra memory), or a frozen copy of
    the base model (placed per algorithm.kl.ref_device; for comparison)."""
    save: Literal["adapter", "merged"] = "adapter"
    """Checkpoints hold the adapters alone (`adapter`, small; eval finds the base through
    adapter_config.json) or the adapters merged into the base as a plain HF model (`merged`)."""


class MonitorConfig(_Section):
    sinks: list[str] | None = None
    """Where metrics go: `jsonl` (RUN_DIR/metrics.jsonl, always on), `tensorboard` (RUN_DIR/tb),
    `wandb`, `mlflow` (docs/metrics.md); a list or a comma-separated string. Unset: jsonl, plus
    TensorBoard when it is installed. A listed sink whose package is missing stops the run at start
    with one line naming the pip extra."""
    project: str = ""
    """W&B project and MLflow experiment; empty: WANDB_PROJECT for W&B when set, else `grpokit`."""
    run_name: str = ""
    """Run name in W&B and MLflow; empty: the run directory's folder name (`runs/grpo` -> `grpo`)."""
    wandb_mode: Literal["offline", "online", "disabled"] | None = None
    """W&B mode; unset: WANDB_MODE when set, else `offline` (files under RUN_DIR/wandb, uploaded
    later by `wandb sync`; no network needed)."""

    @field_validator("sinks", mode="before")
    @classmethod
    def _sink_names(cls, value):
        if value is None:
            return None
        if isinstance(value, str):
            value = [v for v in (x.strip() for x in value.split(",")) if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of sink names ({', '.join(SINK_NAMES)})")
        for name in value:
            if name not in SINK_NAMES:
                close = closest(name, SINK_NAMES)
                hint = f" (did you mean '{close}'?)" if close else ""
                raise ValueError(f"unknown sink '{name}'{hint}; valid sinks: {', '.join(SINK_NAMES)}")
        return ["jsonl"] + [n for i, n in enumerate(value) if n != "jsonl" and n not in value[:i]]


class GuardConfig(_Section):
    max_consecutive_bad: int = Field(3, ge=1)
    """After this many steps in a row whose update was skipped as non-finite, roll back to the last
    healthy checkpoint."""
    rollback_lr_factor: float = Field(0.5, gt=0, le=1)
    """Multiply the learning rate by this at each rollback."""
    max_rollbacks: int = Field(3, ge=0)
    """Give up (stop with an error) after this many rollbacks."""
    ref_check_every: int = Field(10, ge=0)
    """Recompute the reference's log-probs on a fixed probe batch every N steps (0 = never)."""
    ref_tolerance: float = Field(1e-4, ge=0)
    """Largest allowed drift of those log-probs (nats) before `ref/integrity_drift` alarms."""
    ref_strict: bool = False
    """Stop with an error instead of alarming when the reference drifts."""


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
    health: HealthConfig = HealthConfig()
    """Health alarms (grpokit.monitor.health): per-alarm thresholds and action warn / stop / off."""
    guard: GuardConfig = GuardConfig()
    """Non-finite guard, rollback and reference integrity."""
    lora: LoraSection = LoraSection()
    """LoRA / QLoRA adapters (grpokit.train.lora)."""
    monitor: MonitorConfig = MonitorConfig()
    """Metric sinks: JSONL, TensorBoard, W&B, MLflow (grpokit.monitor.sinks)."""

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        self._fold_train_tensorboard()
        r = self.rollout
        if r.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 (group-relative advantages need a group)")
        if r.batch_size % r.group_size:
            raise ValueError(f"rollout.batch_size ({r.batch_size}) must be divisible by rollout.group_size ({r.group_size})")
        if r.engine == "server" and not r.server:
            raise ValueError("rollout.engine=server needs rollout.server=HOST:PORT (a running `grpokit rollout-server`)")
        if r.max_new_tokens <= 0:
            raise ValueError("rollout.max_new_tokens must be > 0")
        if r.batch_size % self.algorithm.mini_batches:
            raise ValueError("rollout.batch_size must be divisible by algorithm.mini_batches")
        if not self.rewards:
            raise ValueError("rewards: at least one reward function is needed")
        names = [r.name for r in self.rewards]
        if self.crosscheck is not None and self.crosscheck.primary not in names:
            raise ValueError(f"crosscheck.primary '{self.crosscheck.primary}' is not one of the rewards "
                             f"({', '.join(names)}){did_you_mean(self.crosscheck.primary, names)}")
        fmt = self.algorithm.sample_filter.format_reward
        if fmt is not None and fmt not in names:
            raise ValueError(f"algorithm.sample_filter.format_reward '{fmt}' is not one of the rewards "
                             f"({', '.join(names)}){did_you_mean(fmt, names)}")
        if r.engine == "vllm" and r.resample_threshold is not None:
            raise ValueError("rollout.resample_threshold is not supported by rollout.engine=vllm "
                             "(vLLM cannot exclude the over-confident token); use engine hf or hf_copy")
        if self.algorithm.dual_clip is not None and self.algorithm.dual_clip <= 1:
            raise ValueError("algorithm.dual_clip must be > 1")
        if self.train.keep_best and self.train.eval_every == 0:
            raise ValueError("train.keep_best chooses among evaluations: set train.eval_every > 0 "
                             "(and data.eval_path, the validation split)")
        if self.lora.load_in_4bit and not self.lora.enabled:
            raise ValueError("lora.load_in_4bit needs lora.enabled=true (4-bit base weights cannot be trained directly)")
        if self.algorithm.length_buckets is not None and self.algorithm.bucket_mode == "quantiles":
            if not all(0 < q < 1 for q in self.algorithm.length_buckets):
                raise ValueError("algorithm.length_buckets must lie in (0, 1) with bucket_mode=quantiles")
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


# --------------------------------------------------------------------------- loading


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        full = f"{prefix}{field.alias or name}"
        keys.append(full)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _valid_keys(ann, full + ".")
    return keys


def _suggest(key: str) -> str:
    hit = closest(key, _valid_keys(Config))
    if hit is None:  # compare leaf names too: "algorithm.eps_hgh" -> "algorithm.eps_high"
        leafs = {k.rsplit(".", 1)[-1]: k for k in _valid_keys(Config)}
        leaf = closest(key.rsplit(".", 1)[-1], leafs, cutoff=0.7)
        hit = leafs[leaf] if leaf is not None else None
    return f" (did you mean '{hit}'?)" if hit is not None else ""


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        return f"unknown config key '{loc}'{_suggest(loc)}"
    msg = e["msg"].removeprefix("Value error, ")
    if not loc:
        return msg
    got = e.get("input")
    named = "(got " in msg or (isinstance(got, str) and repr(got) in msg)   # the value is named already
    got = "" if isinstance(got, (dict, list)) or named else f" (got {got!r})"
    return f"config key '{loc}': {msg}{got}"


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_preset(name_or_path: str) -> Path:
    """A YAML path, or the name of a bundled preset (`dapo` -> grpokit/presets/dapo.yaml)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = PRESET_DIR / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(f.stem for f in PRESET_DIR.glob("*.yaml"))
    close = closest(p.stem, names)
    hint = f" (did you mean preset '{close}'?)" if close else f"; bundled presets: {', '.join(names)}"
    raise ConfigError(f"config file not found: {name_or_path}{hint}")


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ConfigError(f"config 'base:' loop through {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a YAML mapping")
    base = data.pop("base", None)
    if base:
        bases = base if isinstance(base, list) else [base]
        merged: dict = {}
        for b in bases:
            b_path = resolve_preset(b) if not (path.parent / b).is_file() else path.parent / b
            merged = _deep_merge(merged, _read_yaml(b_path, seen + (path.resolve(),)))
        data = _deep_merge(merged, data)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key.sub=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, list)) and raw.strip()[:1] not in "{[":
        value = raw              # "a: b" is a string here, not a mapping; only {..} / [..] are structures
    return key.strip().split("."), value


def load_config(paths: list[str] | str | None = None, overrides: list[str] | None = None) -> Config:
    """Merge YAML files (or preset names) left to right, apply `key=value` overrides, validate."""
    data = read_configs(paths)
    for item in overrides or []:
        keys, value = parse_override(item)
        set_key(data, keys, value, f"override '{item}'")
    return config_from_dict(data)


def read_configs(paths: list[str] | str | None) -> dict:
    """The YAML files (or preset names) merged left to right, as a plain mapping (not validated)."""
    data: dict = {}
    for p in [paths] if isinstance(paths, str) else (paths or []):
        data = _deep_merge(data, _read_yaml(resolve_preset(str(p))))
    return data


def set_key(data: dict, keys: list[str], value: Any, what: str) -> None:
    """Set `keys` (a dotted key split at the dots) in the nested dict `data`, creating sections on
    the way; `what` names the override in the error when a key on the way is not a section."""
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{what}: '{k}' is not a section")
    node[keys[-1]] = value


def config_from_dict(data: dict) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
