"""Config sections `train` (the loop, checkpoints, evaluation), `eval` (the held-out checker),
`lora` and `guard`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from grpokit.config.base import _Section, check_failed


def _checker_name(name: str) -> str:
    if name != "auto":
        from grpokit.config.base import _reward
        _reward(name)
    return name


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
    eval_every: int = Field(10, ge=0)
    """Held-out evaluation (on `data.eval_path`, or the split carved by `data.eval_split`) before the
    first step (logged as step 0), every N steps and after the last; 0 = only before the first and
    after the last. Greedy, on at most 100 carved prompts: cheap enough to leave on, and the
    reward-hacking alarm needs its points (docs/metrics.md)."""
    eval_samples: int = Field(0, ge=0)
    """Sampled completions per eval prompt for `eval/mean@k` (0 = greedy only)."""
    keep_best: bool = False
    """End the run with the policy of the best `eval/pass@1` on the held-out prompts (`data.eval_path`,
    or the split carved by `data.eval_split`; evaluated before
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

    @model_validator(mode="after")
    def _combinations(self):
        if self.keep_best and self.eval_every == 0:
            raise check_failed("train.keep_best chooses among evaluations: set train.eval_every > 0 "
                               "(and data.eval_path, the validation split)")
        return self


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
    architecture in grpokit.models.lora.DEFAULT_TARGETS), `all-linear`, or a list of module names."""
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

    @model_validator(mode="after")
    def _combinations(self):
        if self.load_in_4bit and not self.enabled:
            raise check_failed("lora.load_in_4bit needs lora.enabled=true "
                               "(4-bit base weights cannot be trained directly)")
        return self


class EvalConfig(_Section):
    checker: str = "auto"
    """What scores held-out `eval/pass@1` (and `eval/mean@k`): a registered reward name or an import
    reference, or `auto`: a verifier that shares no code with the training rewards where grpokit has
    one (`math_accuracy_alt` for math answers when it is not itself a training reward, else
    `math_accuracy`; `code_tests`, the unit tests, for code), else the first training reward, with a
    warning at start that the reward-hacking signal is then not independent (docs/rewards.md)."""
    checker_args: dict[str, Any] = {}
    """Arguments for the checker (default: those of a training reward of the same name, if any)."""

    @model_validator(mode="after")
    def _known(self):
        _checker_name(self.checker)
        return self


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
