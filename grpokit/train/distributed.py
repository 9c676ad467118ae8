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

log = logging.getLogger("grpokit.train")

MODES = ("ddp", "fsdp2")


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def resolve_mode(setting: str, world: int) -> str:
    """`train.distributed` at this world size: "none", "ddp" or "fsdp2"."""
    if setting == "auto":
        return "fsdp2" if world > 1 else "none"
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
    if cfg.data.curriculum.enabled:
        raise ConfigError("data.curriculum is not supported with train.distributed (each rank would rank "
                          "prompts from its own statistics and the ranks' data order would diverge)")
    if cfg.algorithm.rewrite.enabled:
        raise ConfigError("algorithm.rewrite is not supported with train.distributed yet")
    if cfg.rollout.engine in ("server", "vllm"):
        raise ConfigError(f"rollout.engine={cfg.rollout.engine} is not supported with train.distributed yet "
                          "(each rank generates with its own copy: use rollout.engine=hf)")
    if cfg.rollout.async_:
        raise ConfigError("rollout.async is not supported with train.distributed yet")
    if cfg.lora.enabled and cfg.lora.load_in_4bit:
        raise ConfigError("lora.load_in_4bit is not supported with train.distributed")


def free_port() -> int:
    """A TCP port free on this machine now (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DistContext:
    """This rank's place in the job, and the collectives the driver and workers use."""

    mode: str                 # "ddp" | "fsdp2"
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
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

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (the guard's and early stop's decisions)."""
        return self.all_max(1.0 if flag else 0.0) > 0

    def gather(self, obj) -> list:
        """`obj` of every rank, in rank order (small Python objects: counts, metric dicts)."""
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier()

    # ------------------------------------------------------------------ data
    def my_prompts(self, indices: list[int]) -> list[int]:
        """This rank's share of a step's global prompt list: every world-th prompt from its rank."""
        return indices[self.rank::self.world]

    def first_group(self, round_idx: int, prompts_per_step: int) -> int:
        """The number of this rank's first group in a sampling round (group numbers unique in the step)."""
        return round_idx * prompts_per_step + self.rank * (prompts_per_step // self.world)

    def keep_groups(self, n_local: int, wanted: int) -> tuple[int, int]:
        """Dynamic sampling over ranks: each rank found `n_local` groups worth keeping; at most
        `wanted` more are needed globally. Returns (groups this rank keeps, groups kept over all
        ranks): the quota is filled in rank order, so the ranks agree without a coordinator."""
        counts = self.gather(int(n_local))
        before = sum(counts[:self.rank])
        mine = max(0, min(n_local, wanted - before))
        return mine, min(sum(counts), wanted)

    def step_seed(self, seed: int, step: int) -> int:
        """The sampling seed of this rank at `step`: derived from (seed, step, rank), so a resumed
        run at the same world size draws exactly what the uninterrupted one drew."""
        return _seed_of(f"{seed}:{step}:{self.rank}")

    def group_seeds(self, seed: int, step: int, first: int, prompts: int) -> list[int]:
        """Sampling seeds of this rank's groups among `prompts` drawn at global position `first` of
        `step`: each derived from (seed, step, the group's global position) alone, so a group draws
        the same completions at any world size (exact resume 2 -> 1 -> 2)."""
        return [_seed_of(f"{seed}:{step}:g{first + q}") for q in self.my_prompts(list(range(prompts)))]

    # ------------------------------------------------------------------ metrics
    def reduce_metrics(self, metrics: dict, agreed: set[str] = frozenset()) -> dict:
        """Every rank's metrics combined into the job's (the same dict on every rank): sums for the
        per-rank shares of a global quantity, max / min for extremes and times, the mean of the
        ranks' values otherwise (docs/distributed.md, "Metrics"). Keys in `agreed` already hold the
        job's value on every rank and are kept as they are."""
        numeric = {k: float(v) for k, v in metrics.items() if k not in agreed
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        rest = {k: v for k, v in metrics.items() if k not in numeric}
        every = self.gather(numeric)
        out: dict = {}
        for k in dict.fromkeys(k for d in every for k in d):
            vals = [d[k] for d in every if k in d]
            how = reduction(k)
            out[k] = sum(vals) if how == "sum" else max(vals) if how == "max" else min(vals) if how == "min" \
                else sum(vals) / len(vals)
        return {**out, **rest}


def _seed_of(key: str) -> int:
    """A 63-bit seed from a string key (stable across processes and Python versions)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


SUMMED = ("loss/", "throughput/", "reward/nonfinite", "rollout/resampled", "filter/dropped")
"""Metrics that are each rank's share of a job-wide total: the losses (each rank's loss is
normalised by the global token or sequence count, so the shares add up to the global loss),
throughput, and counts of events."""


def reduction(key: str) -> str:
    """How `key` combines over ranks: "sum", "max", "min" or "mean"."""
    if key.startswith(SUMMED) or key.endswith("/errors"):
        return "sum"
    if key.startswith(("time/", "memory/")) or key.endswith(("_max", "ratio_max", "/integrity_drift")):
        return "max"                   # the slowest rank sets the pace; the largest process the memory
    if key.endswith("_min"):
        return "min"
    return "mean"


# ---------------------------------------------------------------------- process group
def init(cfg) -> DistContext | None:
    """Join the job torchrun started (rank, world size, local rank from its environment), or None
    for a single process. Collectives time out after `train.dist_timeout_s`, so a dead rank stops
    the others in bounded time; mismatched configs between ranks are refused here."""
    world = world_size_from_env()
    mode = resolve_mode(cfg.train.distributed, world)
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
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
        else:                                  # one process asked for ddp / fsdp2 without torchrun
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if mode == "fsdp2" and cfg.lora.enabled and cfg.lora.reference == "adapter_off":
        raise ConfigError("lora.reference=adapter_off is not supported with train.distributed=fsdp2 (the "
                          "reference would run through the sharded policy); use lora.reference=copy")
    ctx = DistContext(mode=mode, rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, device=device)
    torch.manual_seed(cfg.train.seed + ctx.rank)      # per-rank streams for anything else that draws
    check_same_config(ctx, cfg)
    return ctx


def shutdown() -> None:
    """Leave the process group (when one was joined)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


# ---------------------------------------------------------------------- launch
def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs `grpokit <argv>` on `nproc` local ranks through torchrun
    (torch.distributed.run), rendezvous on a free local port."""
    import sys
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "grpokit", *argv]
