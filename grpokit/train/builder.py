"""From config to a run: the one place where config becomes objects.

`build_run(cfg)` loads and checks the prompts, joins the job (a `Comm`: one process, or a rank of
torchrun's), loads the policy and its reference, and wires the worker, the rollout engine, the
rewards, the transforms, the KL controller, the guard, the health monitor and the run directory
into a `Trainer` (grpokit.train.run). The CLI, `grpokit.GRPO`, the demo, `compare`, the benches and
the examples all build through it, so a run behaves the same whichever face started it;
`build_eval` does the same for `grpokit eval`.
"""

from __future__ import annotations

from typing import NamedTuple

import logging
from pathlib import Path

import torch

from grpokit.errors import ConfigError

log = logging.getLogger("grpokit.train")


# ---------------------------------------------------------------------- parts
def build_rewards(cfg, *, run_dir=None):
    """The run's RewardSet, with the cross-checker when one is configured."""
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
    from grpokit.config.kl_control import kl_target_high

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


def carve_eval_split(cfg, dataset, eval_dataset):
    """(training, held-out) prompts: with no held-out prompts given, `data.eval_split` of the training
    prompts carved off (seeded, grpokit.data.datasets.carve_heldout) and said so; a dataset too small
    to spare them trains whole, with a warning that no held-out accuracy (and so no reward-hacking
    signal) will be measured."""
    from grpokit.data.datasets import carve_heldout

    d = cfg.data
    if eval_dataset is not None or d.eval_split == 0:
        return dataset, eval_dataset
    got = carve_heldout(dataset, d.eval_split, d.eval_split_max, cfg.train.seed)
    if isinstance(got, str):
        log.warning("no held-out split: %s (data.eval_split); without held-out prompts there is no eval/pass@1 "
                    "and the reward-hacking alarm cannot fire: give data.eval_path", got)
        return dataset, None
    train, held = got
    log.info("held-out split: %d prompts of %s carved for evaluation (data.eval_split=%g, seed %d; %d of %d "
             "rows left to train on; data.eval_path gives your own, data.eval_split=0 none)", len(held),
             dataset.source or "the dataset", d.eval_split, cfg.train.seed, len(train), len(dataset))
    return train, held


def open_comm(cfg):
    """This process's `Comm`: a rank of the torchrun job it was started in, else a single process."""
    from grpokit.train import distributed
    from grpokit.train.comm import LocalComm

    return distributed.init(cfg) or LocalComm()


def step_settings(cfg):
    """What `grpokit.train.step.Step` needs of the config."""
    from grpokit.train.step import StepSettings

    a, r = cfg.algorithm, cfg.rollout
    return StepSettings(
        advantage=a.advantage, adv_eps=a.adv_eps,
        length_buckets=a.length_buckets, bucket_mode=a.bucket_mode if a.length_buckets is not None else None,
        kl_in_reward=a.kl.in_reward, kl_unit=a.kl.target_unit, resampling=r.resample_threshold is not None,
        is_cap=r.is_cap, is_correction=r.is_correction, old_logp_needed=a.mu > 1 or a.mini_batches > 1,
        pass_reward=cfg.rewards[0].name, pass_threshold=a.pass_threshold, kl_estimator=a.kl.estimator,
        kl_measure_every=a.kl.measure_every, kl_measure_rows=a.kl.measure_rows)


def sampling_params(cfg):
    from grpokit.rollout.base import SamplingParams

    r = cfg.rollout
    return SamplingParams(n=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, resample_threshold=r.resample_threshold,
                          ignore_eos=r.ignore_eos)


def _policy(cfg, model, tokenizer):
    """(policy, reference, tokenizer): the tokenizer of `model.path` unless given, the policy (LoRA /
    QLoRA when lora.enabled) and its reference (grpokit.train.reference), or None."""
    from grpokit.models import load_tokenizer
    from grpokit.train.build import build_policy

    m = cfg.model
    if tokenizer is None:
        tokenizer = load_tokenizer(m.path, trust_remote_code=m.trust_remote_code, gguf_file=m.gguf_file)
    model, reference = build_policy(cfg, model)
    return model, reference, tokenizer


def _encoder(cfg, model, tokenizer, datasets):
    """The prompt encoder, the tokenizer's round trip and every prompt's length checked against
    the model's context (one line each, before any step)."""
    from grpokit.models.hf import check_round_trip
    from grpokit.train.prompts import PromptEncoder, check_prompts, max_positions

    check_round_trip(tokenizer, [r["prompt"] for r in datasets[0].rows[:8] if isinstance(r["prompt"], str)])
    encoder = PromptEncoder(tokenizer, cfg.data.chat_template)
    for ds, what in zip(datasets, ("data.path", "data.eval_path")):
        if ds is not None:
            check_prompts(encoder, ds.rows, ds.source or what, max_new_tokens=cfg.rollout.max_new_tokens,
                          positions=max_positions(model))
    return encoder


def _report_at_exit(trainer) -> None:
    """RUN_DIR/report.html when the run ends, however it ends."""
    from grpokit.monitor.report import write_report_at_end

    write_report_at_end(trainer.run_dir)


def _fresh_start_notes(cfg, rewards, dataset, encoder):
    """The set-up warnings of a fresh (not resumed) run: the batch-size advice and the rewards'
    determinism check."""
    from grpokit.rewards.determinism import check_rows
    from grpokit.train.build import batch_advice

    def notes() -> list[str]:
        out = [a for a in [batch_advice(cfg)] if a]
        if cfg.train.check_rewards:              # rewards must be deterministic
            out += list(check_rows(rewards, dataset, prompt_text=encoder.text,
                                   max_new_tokens=cfg.rollout.max_new_tokens))
        return out
    return notes


# ---------------------------------------------------------------------- the run
def build_run(cfg, *, model=None, tokenizer=None, dataset=None, eval_dataset=None, worker=None, engine=None,
              env=None, health: bool = True, report: bool = True):
    """A ready `Trainer` for `cfg`. `model` / `tokenizer`: already loaded ones instead of
    `model.path`'s; `dataset` / `eval_dataset`: `PromptDataset`s (grpokit.data.datasets) instead of
    `data.path` / `data.eval_path`'s; `worker`: a built training worker (its model and reference are
    the run's); `engine`: a rollout engine instead of `rollout.engine`'s; `env`: an `EnvSpec`
    (grpokit.rollout.episodes) instead of `rollout.env` / `rollout.tools`'s. `health`: run the health
    monitor (on the main rank); `report`: write RUN_DIR/report.html when `train` ends."""
    from grpokit import hostmem
    from grpokit.monitor.sinks import check_sinks

    hostmem.tune()            # large per-step buffers reused from the heap, not faulted in afresh
    check_sinks(cfg)          # a missing wandb / mlflow package: one line now, before the model loads
    # the prompts, and the columns the rewards read, are checked before the (slow) model loading
    dataset, eval_ds = carve_eval_split(cfg, *load_datasets(cfg, dataset, eval_dataset))
    if cfg.train.keep_best and eval_ds is None:
        raise ConfigError("train.keep_best needs a validation split (data.eval_path, or one carved: "
                          "data.eval_split) and one process")
    # a single process: rank 0 of 1 (docs/distributed.md); a built data-parallel worker has its own,
    # which its caller owns (and closes)
    given = getattr(worker, "ctx", None)
    comm = given or open_comm(cfg)
    try:
        if cfg.train.keep_best and comm.mode != "none":     # best/ is a plain model directory
            raise ConfigError("train.keep_best runs in one process only")
        return _assemble(cfg, comm, model, tokenizer, dataset, eval_ds, worker, engine, env, health, report,
                         close=given is None)
    except BaseException:
        if given is None:
            comm.close()
        raise


def _assemble(cfg, comm, model, tokenizer, dataset, eval_ds, worker, engine, env, health, report, close=True):
    from grpokit.data.curriculum import Curriculum
    from grpokit.data.datasets import PromptSampler
    from grpokit.rollout.registry import build_engine
    from grpokit.train.collect import Collector, owns_weights
    from grpokit.train.distributed import GatheredEngine, model_dir_of
    from grpokit.train.guard import Guard
    from grpokit.config.kl_control import build_kl_controller
    from grpokit.train.reference import ReferenceProbe
    from grpokit.train.run import Trainer
    from grpokit.train.rundir import RunDir
    from grpokit.train.step import Step, sync_weights
    from grpokit.train.transforms import DynamicSampling, build_transforms
    from grpokit.train.worker import LocalWorker

    if worker is None:
        model, reference, tokenizer = _policy(cfg, model, tokenizer)
        if comm.mode != "none":
            from grpokit.train.dist_worker import DataParallelWorker
            worker = DataParallelWorker(cfg, model, tokenizer, reference, comm)   # DDP / FSDP2 over this rank's copy
        else:
            worker = LocalWorker(cfg, model, tokenizer, reference)
    elif tokenizer is None:
        raise ConfigError("build_run: a worker comes with its tokenizer (tokenizer=)")
    encoder = _encoder(cfg, worker.model, tokenizer, (dataset, eval_ds))
    r, cur = cfg.rollout, cfg.data.curriculum
    if engine is None and r.engine == "server" and comm.mode != "none":
        # every rank generates its own groups on the server; rank 0 alone sends the weights, which
        # every rank exports together (an FSDP2 export gathers each tensor collectively)
        engine = build_engine(r.engine, worker.model, tokenizer, rollout=r, sends_weights=comm.is_main, push=False)
        engine.barrier = comm.barrier
        sync_weights(engine, worker, 0, comm)
    elif engine is None and r.engine == "vllm" and comm.mode != "none":
        # every rank's vLLM (one engine per tensor-parallel group, vLLM's external_launcher) starts
        # from the model's directory and is pushed the worker's weights at once (a sharded policy
        # cannot be saved for it; the export gathers collectively)
        from grpokit.rollout.registry import lora_rank_of
        lora = lora_rank_of(worker.model) if r.sync_adapters else None
        engine = build_engine(r.engine, model_dir_of(worker.model), tokenizer, rollout=r, lora_rank=lora)
        sync_weights(engine, worker, 0, comm)
    elif engine is None:
        engine = build_engine(r.engine, worker.model, tokenizer, rollout=r)
    if getattr(worker, "gathered", None) is not None and not owns_weights(engine):  # sharded weights:
        engine = GatheredEngine(engine, worker)                                     # gathered once per rollout
    dev = next(worker.model.parameters()).device
    gen = torch.Generator(device="cpu" if dev.type == "cpu" else dev)
    gen.manual_seed(cfg.train.seed)
    curriculum = (Curriculum(start=cur.start, end=cur.end, ramp_steps=cur.ramp_steps, pool_factor=cur.pool_factor,
                             ema=cur.ema, prior=cur.prior, prior_field=cur.prior_field, bar=cur.bar,
                             rise_from=cur.rise_from, rise_to=cur.rise_to, running_ema=cur.running_ema)
                  if cur.enabled else None)
    dynamic = None
    if r.dynamic_sampling:
        dynamic = DynamicSampling(cfg.rewards[0].name if r.dynamic_sampling_on == "pass" else None,
                                  cfg.algorithm.pass_threshold)
    rewards = build_rewards(cfg)
    collector = Collector(
        engine=engine, encoder=encoder, rewards=rewards, dataset=dataset, comm=comm, gen=gen,
        sampler=PromptSampler(len(dataset), seed=cfg.train.seed, shuffle=cfg.data.shuffle),
        params=sampling_params(cfg), prompts_per_step=cfg.prompts_per_step, seed=cfg.train.seed,
        max_rounds=r.max_sampling_rounds, dynamic=dynamic, curriculum=curriculum, pool_factor=cur.pool_factor,
        pad_id=tokenizer.pad_token_id, async_=r.async_, steps=cfg.train.steps,
        episodes=build_episodes(cfg, engine, tokenizer, env), width=r.dynamic_width,
        confidence=r.dynamic_confidence)
    run = RunDir(cfg, comm)
    probe = ReferenceProbe(cfg.guard) if worker.reference is not None and cfg.guard.ref_check_every else None
    step = Step(settings=step_settings(cfg), collector=collector, worker=worker,
                transforms=build_transforms(cfg, tokenizer=tokenizer, curriculum=curriculum,
                                            diagnose=collector.diagnose, comm=comm,
                                            sampled=collector.take_scored),
                kl_ctl=build_kl_controller(cfg), guard=Guard(cfg.guard.max_consecutive_bad), comm=comm, run=run,
                ref_probe=probe, seed=cfg.train.seed, entropy_ctl=_entropy_control(cfg))
    monitor = build_health(cfg) if health and comm.is_main else None
    on_exit = (([_report_at_exit] if report and comm.is_main else [])
               + ([lambda _: collector.episodes.close()] if collector.episodes is not None else [])   # an endpoint
               + ([lambda _: comm.close()] if close else []))
    from grpokit.train.evaluate import build_checker

    checker = build_checker(cfg, eval_ds, say=comm.is_main) if eval_ds is not None else None
    return Trainer(cfg, step=step, worker=worker, run=run, comm=comm, tokenizer=tokenizer, dataset=dataset,
                   rewards=rewards, encoder=encoder, eval_dataset=eval_ds, checker=checker, health=monitor,
                   on_exit=on_exit,
                   fresh_notes=_fresh_start_notes(cfg, rewards, dataset, encoder))


def _entropy_control(cfg):
    """Adaptive entropy control (`algorithm.entropy_target`), or None."""
    a = cfg.algorithm
    if a.entropy_target is None:
        return None
    from grpokit.algo.entropy import EntropyControl

    return EntropyControl(target=a.entropy_target, step=a.entropy_coef_step, max_coef=a.entropy_coef_max,
                          coef=a.entropy_coef)


# ---------------------------------------------------------------------- evaluation
def build_episodes(cfg, engine, tokenizer, spec=None):
    """The multi-turn episode runner over `engine` (`spec`: an EnvSpec or an agent-loop function; else
    `rollout.env` / `rollout.tools` / `rollout.agent.loop`), or None."""
    r = cfg.rollout
    if not r.episodes and spec is None:
        return None
    from grpokit.rollout.episodes import EnvSpec, EpisodeRunner, EpisodeSettings, LoopRunner, load_object

    a = r.agent
    if spec is not None and not isinstance(spec, EnvSpec):      # an agent loop given as a function
        return LoopRunner(engine, tokenizer, spec, wait_s=a.tool_timeout_s)
    if a.openai and spec is None:
        from grpokit.rollout.episodes.gateway import OpenAIAgent

        fn = load_object(a.openai, "rollout.agent.openai")
        eos = list(getattr(engine, "eos_ids", None) or [tokenizer.eos_token_id])
        return LoopRunner(engine, tokenizer, OpenAIAgent(fn, tokenizer, eos), wait_s=a.tool_timeout_s,
                          name="rollout.agent.openai")
    if a.loop and spec is None:
        fn = load_object(a.loop, "rollout.agent.loop")
        if not callable(fn):
            raise ConfigError(f"rollout.agent.loop {a.loop} is not a function")
        return LoopRunner(engine, tokenizer, fn, wait_s=a.tool_timeout_s)
    return EpisodeRunner(engine, tokenizer, spec or EnvSpec.from_config(r.env, r.tools),
                         EpisodeSettings(max_turns=a.max_turns, max_observation_tokens=a.max_observation_tokens,
                                         tool_timeout_s=a.tool_timeout_s, tool_workers=a.tool_workers,
                                         segments=a.segments, scheduling=a.scheduling))


class EvalParts(NamedTuple):
    engine: object
    encoder: object
    rewards: object           # the held-out checker's RewardSet (eval.checker)
    dataset: object
    episodes: object          # the multi-turn runner, or None


def build_eval(cfg, model_path: str) -> EvalParts:
    """What scoring `model_path` on `data.path` takes (`grpokit eval`): the prompts and their columns
    checked before the model loads, the prompts against its context; with `rollout.env` /
    `rollout.tools`, the episode runner (the same loop evaluates)."""
    from grpokit.data.datasets import PromptDataset
    from grpokit.rollout.registry import build_engine
    from grpokit.models import load_model, load_tokenizer
    from grpokit.train.prompts import PromptEncoder, check_prompts, max_positions

    ds, _ = load_datasets(cfg)
    tok = load_tokenizer(model_path)
    model = load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
    encoder = PromptEncoder(tok, cfg.data.chat_template)
    check_prompts(encoder, ds.rows, ds.source, max_new_tokens=cfg.rollout.max_new_tokens, positions=max_positions(model))
    from grpokit.train.evaluate import build_checker

    engine = build_engine(cfg.rollout.engine, model, tok, rollout=cfg.rollout)
    return EvalParts(engine, encoder, build_checker(cfg, ds), PromptDataset(ds.rows), build_episodes(cfg, engine, tok))
