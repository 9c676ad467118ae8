"""Training: model loading, the GRPO loop, checkpoints. `build_trainer(cfg)` turns a config into a
ready `Trainer` (config is read here, at the edge; inner code receives explicit objects)."""

from __future__ import annotations

import logging

log = logging.getLogger("grpokit.train")


def build_rewards(cfg, *, run_dir=None):
    """The run's RewardSet, with the cross-checker when one is configured."""
    from pathlib import Path

    from grpokit.rewards import CrossCheck, RewardSet

    cc = None
    if cfg.crosscheck is not None:
        dump = Path(run_dir or cfg.train.run_dir) / "disagreements.jsonl"
        cc = CrossCheck(**cfg.crosscheck.model_dump(), dump_path=dump, seed=cfg.train.seed)
    return RewardSet.from_specs([s.model_dump() for s in cfg.rewards], crosscheck=cc)


def build_health(cfg):
    """The health monitor, with the thresholds that live elsewhere in the config filled in unless the
    user set them: the KL controller's upper target for `kl_climbing.kl_high`, the guard's tolerance
    for `ref_drift.tolerance`. Each field is checked on its own, so setting another field of the same
    alarm (e.g. `health.kl_climbing.action=stop`) keeps the filled-in value."""
    from grpokit.monitor.health import HealthConfig, HealthMonitor
    from grpokit.train.kl_control import kl_target_high

    h = cfg.health.model_dump()
    if "kl_high" not in cfg.health.kl_climbing.model_fields_set:
        h["kl_climbing"]["kl_high"] = kl_target_high(cfg)
        if "unit" not in cfg.health.kl_climbing.model_fields_set:
            h["kl_climbing"]["unit"] = cfg.algorithm.kl.target_unit
    if "tolerance" not in cfg.health.ref_drift.model_fields_set:
        h["ref_drift"]["tolerance"] = cfg.guard.ref_tolerance
    return HealthMonitor(HealthConfig(**h), cfg.train.run_dir, print_fn=log.warning)


def load_datasets(cfg, dataset=None, eval_dataset=None):
    """The training and held-out `PromptDataset`s (`data.path`, `data.eval_path`, or those given),
    checked to hold every column the configured rewards read (grpokit.rewards.user.check_columns)."""
    from grpokit.data.datasets import load_prompts
    from grpokit.rewards import check_columns

    d = cfg.data
    if dataset is None:
        dataset = load_prompts(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field)
    if eval_dataset is None and d.eval_path:
        eval_dataset = load_prompts(d.eval_path, prompt_field=d.prompt_field, answer_field=d.answer_field)
    for ds, what in ((dataset, "data.path"), (eval_dataset, "data.eval_path")):
        if ds is not None:
            check_columns(cfg.rewards, ds.rows, ds.source or what)
    return dataset, eval_dataset


def build_trainer(cfg, *, model=None, tokenizer=None, health=True, dataset=None, eval_dataset=None):
    """A ready Trainer for `cfg`. `model` / `tokenizer`: already loaded ones instead of `model.path`'s;
    `dataset` / `eval_dataset`: `PromptDataset`s (grpokit.data.datasets) instead of `data.path` /
    `data.eval_path`'s."""
    from grpokit.monitor.sinks import check_sinks
    from grpokit.train import distributed
    from grpokit.train.build import build_policy, load_tokenizer
    from grpokit.train.loop import Trainer
    from grpokit.train.model import check_round_trip
    from grpokit.train.prompts import PromptEncoder, check_prompts, max_positions

    check_sinks(cfg)          # a missing wandb / mlflow package: one line now, before the model loads
    # the prompts, and the columns the rewards read, are checked before the (slow) model loading
    dataset, eval_ds = load_datasets(cfg, dataset, eval_dataset)
    dist_ctx = distributed.init(cfg)          # None for a single process (docs/distributed.md)
    m = cfg.model
    if tokenizer is None:
        tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code, gguf_file=m.gguf_file)
    # the policy (LoRA / QLoRA when lora.enabled) and its reference (grpokit.train.reference), or None
    model, reference = build_policy(cfg, model)
    sample = [r["prompt"] for r in dataset.rows[:8] if isinstance(r["prompt"], str)]
    check_round_trip(tokenizer, sample)
    encoder = PromptEncoder(tokenizer, cfg.data.chat_template)
    for ds, what in ((dataset, "data.path"), (eval_ds, "data.eval_path")):
        if ds is not None:
            check_prompts(encoder, ds.rows, ds.source or what, max_new_tokens=cfg.rollout.max_new_tokens,
                          positions=max_positions(model))
    rewards = build_rewards(cfg)
    worker = None
    if dist_ctx is not None:                  # DDP / FSDP2 over this rank's copy of the policy
        from grpokit.train.dist_worker import DataParallelWorker
        worker = DataParallelWorker(cfg, model, tokenizer, reference, dist_ctx)
    monitor = build_health(cfg) if health and (dist_ctx is None or dist_ctx.is_main) else None
    return Trainer(cfg, model, tokenizer, dataset, rewards, eval_dataset=eval_ds, health=monitor, reference=reference,
                   worker=worker)
