"""Training on several processes with PyTorch's own stack: `torchrun` starts the ranks, a
process group (gloo on CPU, NCCL on GPUs) joins them, DDP or FSDP2 (grpokit.train.dist_worker)
holds the policy. This module is what the driver needs besides the worker: process-group set-up
and tear-down, the collective decisions (stop, skip, keep), metric reduction, and each rank's
share of a step's prompts (docs/distributed.md).

Single process (`train.distributed: none`, or `auto` at world size 1) never imports
torch.distributed: `init` returns None and the driver runs as before.

How data parallelism is placed (docs/distributed.md, "Groups and normalisation"): every rank draws
the same global list of prompts from the shared, seeded sampler and keeps every world-th one, so a
group never spans ranks (its advantage statistics stay local) and the global data order does not
depend on the world size; the loss normalisers (tokens, sequences) are summed over ranks, so N
processes compute the gradient one process computes on the same global batch.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import socket
from dataclasses import dataclass

import torch

from grpokit.errors import ConfigError
from grpokit.train.comm import SUMMED, Comm, reduction, seed_of  # noqa: F401  (re-exported)

log = logging.getLogger("grpokit.train")

MODES = ("ddp", "fsdp2")


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def resolve_mode(setting: str, world: int, lora=None) -> str:
    """`train.distributed` at this world size: "none", "ddp" or "fsdp2". `auto` is FSDP2, except
    with LoRA adapters on a frozen base that FSDP2 cannot serve (`lora`: the config's section): a
    4-bit base (its packed weights cannot be sharded) or the exact adapter-off reference (it would
    run through the sharded policy). There DDP replicates the frozen base, a quarter of its
    16-bit size when 4-bit, and reduces only the adapters' gradients."""
    if setting == "auto":
        if world <= 1:
            return "none"
        return "ddp" if ddp_only(lora) else "fsdp2"
    if setting == "none" and world > 1:
        raise ConfigError(f"train.distributed=none, but this process is one of WORLD_SIZE={world} ranks "
                          "(use ddp, fsdp2 or auto, or launch a single process)")
    return setting


def check_config(cfg, world: int) -> None:
    """What a data-parallel run cannot do, as one-line errors before anything is built."""
    P = cfg.prompts_per_step
    if P % world:
        raise ConfigError(f"rollout.batch_size / rollout.group_size = {P} prompts per step is not divisible by "
                          f"the world size {world}: every rank takes whole groups, the same number each")
    tp = cfg.rollout.vllm.tensor_parallel_size
    if cfg.rollout.engine == "vllm" and world % tp:
        raise ConfigError(f"rollout.vllm.tensor_parallel_size={tp} does not divide the world size {world}: each "
                          "group of that many ranks forms one vLLM engine (vLLM's external_launcher)")
    if cfg.rollout.engine == "hf_copy" and resolve_mode(cfg.train.distributed, world, cfg.lora) == "fsdp2":
        raise ConfigError("rollout.engine=hf_copy does not run under train.distributed=fsdp2 (its copy of the "
                          "policy would be a sharded module); use rollout.engine=hf (each rollout gathers the "
                          "shards once), a rollout server, or train.distributed=ddp")
    if resolve_mode(cfg.train.distributed, world, cfg.lora) == "fsdp2" and (why := ddp_only(cfg.lora)):
        raise ConfigError(f"train.distributed=fsdp2 cannot shard a LoRA run with {why}; use train.distributed=ddp "
                          "(or auto): the frozen base is replicated and only the adapters' gradients are reduced")


def ddp_only(lora) -> str:
    """Why a LoRA setup needs DDP rather than FSDP2 ("" when it does not)."""
    if lora is None or not lora.enabled:
        return ""
    if lora.load_in_4bit:
        return ("a 4-bit base (lora.load_in_4bit: bitsandbytes packs each weight with per-block constants "
                "that FSDP2's row sharding would split)")
    if lora.reference == "adapter_off":
        return "lora.reference=adapter_off (the reference would run through the sharded policy; or set lora.reference=copy)"
    return ""


def free_port() -> int:
    """A TCP port free on this machine now (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DistContext(Comm):
    """This rank's place in a torchrun job, and the collectives (over the default process group)
    that the driver, the workers and the run directory use (grpokit.train.comm)."""

    mode: str                 # "ddp" | "fsdp2"
    rank: int
    world: int
    local_rank: int
    device: torch.device
    per_group_streams = True

    def _reduce(self, values: list[float], op) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def all_sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist
        return self._reduce(values, dist.ReduceOp.SUM)

    def all_max(self, value: float) -> float:
        import torch.distributed as dist
        return self._reduce([value], dist.ReduceOp.MAX)[0]

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()

    def close(self) -> None:
        shutdown()


# ---------------------------------------------------------------------- process group
def init(cfg) -> DistContext | None:
    """Join the job torchrun started (rank, world size, local rank from its environment), or None
    for a single process. Collectives time out after `train.dist_timeout_s`, so a dead rank stops
    the others in bounded time; mismatched configs between ranks are refused here."""
    world = world_size_from_env()
    mode = resolve_mode(cfg.train.distributed, world, cfg.lora)
    if mode == "none":
        return None
    check_config(cfg, world)
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and cfg.model.device != "cpu"
    if cuda:
        torch.cuda.set_device(local)           # "cuda" then means this rank's GPU when the model loads
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    timeout = datetime.timedelta(seconds=cfg.train.dist_timeout_s)
    global _joined
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        _joined = True
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
        else:                                  # one process asked for ddp / fsdp2 without torchrun
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    ctx = DistContext(mode=mode, rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, device=device)
    if cfg.train.distributed == "auto" and mode == "ddp" and ctx.rank == 0:
        log.info("train.distributed=auto: DDP, as FSDP2 cannot shard a LoRA run with %s", ddp_only(cfg.lora))
    torch.manual_seed(cfg.train.seed + ctx.rank)      # per-rank streams for anything else that draws
    check_same_config(ctx, cfg)
    return ctx


_joined = False
"""True once this process has joined a process group (its gloo / NCCL threads outlive it)."""


def shutdown() -> None:
    """Leave the process group (when one was joined)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End this process with `code`. A rank that has joined a process group ends without the
    interpreter's finalization: gloo's worker threads live on after `destroy_process_group` (the
    backend keeps them), and one that drops its last collective's tensors while the interpreter is
    being torn down needs the GIL, cannot get it, and aborts the process ("terminate called without
    an active exception", SIGABRT) although the run finished. So the rank tears down in order
    itself: the process group, then the exit handlers (sinks, reward workers), then the streams,
    and leaves with `os._exit`. A process that never joined one exits as usual."""
    import sys

    code = code if isinstance(code, int) else (0 if code is None else 1)
    import torch.distributed as dist

    if not (_joined or (dist.is_available() and dist.is_initialized())):
        sys.exit(code)
    import atexit
    import logging as _logging
    import traceback

    try:
        shutdown()
    except Exception:                         # a failed teardown is a failed run, said so
        traceback.print_exc()
        code = code or 1
    finally:
        atexit._run_exitfuncs()
        _logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def config_digest(cfg) -> str:
    from grpokit.config import dump_config
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()[:16]


def check_same_config(ctx: DistContext, cfg) -> None:
    """Refuse to start when the ranks were given different configs (e.g. different overrides)."""
    digests = ctx.gather(config_digest(cfg))
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise ConfigError(f"the ranks were started with different configs (ranks {odd} differ from rank 0); "
                          "every rank must get the same config files and overrides")


# ---------------------------------------------------------------------- generation
def model_dir_of(model) -> str:
    """The Hugging Face directory a (possibly PEFT-wrapped) model was loaded from: what each rank's
    vLLM engine starts from before it is pushed the trained weights."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = getattr(base.config, "_name_or_path", "") or ""
    if not (path and os.path.isfile(os.path.join(path, "config.json"))):
        raise ConfigError("rollout.engine=vllm under torchrun starts each rank's engine from the model's directory, "
                          f"and this model has none ({path or 'built in memory'}): load it from a Hugging Face "
                          "directory (model.path), or use rollout.engine=hf or a rollout server")
    return path


class GatheredEngine:
    """A rollout engine over an FSDP2-sharded policy: its parameters are gathered once per
    `generate` call (`unshard()` on every FSDP module), not once per decoding step, so the ranks may
    decode different numbers of steps without any collective in between; `reshard()` after."""

    def __init__(self, engine, worker):
        self.inner, self.worker = engine, worker

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        with self.worker.gathered():
            return self.inner.generate(*args, **kwargs)


@contextlib.contextmanager
def gathered(modules):
    """All parameters of the given FSDP modules unsharded within (one all-gather each)."""
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
