"""From config to the objects a run trains: the policy (plain, LoRA or QLoRA) and its reference.

Loading itself lives in grpokit.models (plain Hugging Face directories, LoRA adapters and 4-bit
bases, GGUF files, sharded checkpoints), shared with rollout; what stays here depends on training
objects (the reference, the batch advice).
"""

from __future__ import annotations

import logging

from grpokit.models import gguf, lora
from grpokit.models.hf import ModelLoadError
from grpokit.models.loading import load_model
from grpokit.train.reference import Reference

log = logging.getLogger("grpokit.train")


def reference_for(cfg, policy) -> Reference | None:
    """pi_ref for `policy`: None when beta = 0 and KL is not measured (`algorithm.kl.measure_every`
    0); the policy with its adapters off for a LoRA policy (unless `lora.reference: copy`);
    otherwise a frozen copy placed per `algorithm.kl.ref_device`."""
    k = cfg.algorithm.kl
    if k.beta == 0 and k.measure_every == 0:
        return None
    kw = dict(dropout=k.ref_dropout, cache_size=k.ref_cache, temperature=cfg.rollout.temperature,
              chunk_tokens=cfg.optim.logprob_chunk)
    if lora.is_peft(policy) and cfg.lora.reference == "adapter_off":
        return Reference.of_adapters_off(policy, **kw)
    base = policy.get_base_model() if lora.is_peft(policy) else policy
    return Reference.frozen(base, placement=k.ref_device, **kw)


def build_policy(cfg, model=None):
    """(policy, reference) for a config: the model (loaded from `model.path` unless given), wrapped
    with LoRA adapters when `lora.enabled` (on a 4-bit base with `lora.load_in_4bit`), and its
    reference from `reference_for` (a `lora.reference: copy` reference is copied before the
    adapters are injected)."""
    m, lc = cfg.model, cfg.lora
    if model is None:
        if lc.enabled and lc.load_in_4bit:
            model = lora.load_4bit_model(gguf.resolve_model_dir(m.path, m.gguf_file), lc, dtype=m.dtype, device=m.device,
                                         gradient_checkpointing=m.gradient_checkpointing,
                                         trust_remote_code=m.trust_remote_code)
        else:
            model = load_model(m.path, dtype=m.dtype, device=m.device,
                               gradient_checkpointing=m.gradient_checkpointing, trust_remote_code=m.trust_remote_code,
                               gguf_file=m.gguf_file)
    elif lc.load_in_4bit and not getattr(model, "is_loaded_in_4bit", False):
        raise ModelLoadError("lora.load_in_4bit: the model passed in is not 4-bit; let grpokit load it from model.path")
    if not lc.enabled:
        return model, reference_for(cfg, model)
    if lc.save == "merged" and not cfg.model.path:
        raise ValueError("lora.save=merged needs model.path")
    copied = reference_for(cfg, model) if lc.reference == "copy" else None
    policy = lora.wrap_lora(model, lc)
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in policy.parameters())
    log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.2f%%)%s", lc.rank, lc.alpha,
             lora.target_modules_for(model.config.model_type, lc.target_modules), n_train, n_all,
             100 * n_train / max(n_all, 1), ", 4-bit base" if lc.load_in_4bit else "")
    return policy, (copied if lc.reference == "copy" else reference_for(cfg, policy))


SMOOTH_BATCH = (512, 2048)        # responses per step for smooth curves (practitioner's batch rule)


def batch_advice(cfg) -> str | None:
    """A warning when a run's batch is far (4x or more) below the responses per step that give
    smooth curves, unless `train.batch_advice` is off."""
    n = cfg.rollout.batch_size
    if not cfg.train.batch_advice or n * 4 > SMOOTH_BATCH[0]:
        return None
    return (f"rollout.batch_size={n} responses per step is far below the {SMOOTH_BATCH[0]}-{SMOOTH_BATCH[1]} "
            "that give smooth curves (docs/training.md, practitioner's rules): expect noisy metrics and "
            "alarms; raise rollout.batch_size (optim.micro_batch_size bounds the memory), or set "
            "train.batch_advice=false")
