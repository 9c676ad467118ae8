"""The weight group: a torch.distributed process group of exactly two members, the trainer (rank 0,
which sends) and a rollout server (rank 1, which receives), over which full weights are broadcast
after every optimizer step.

The group is built directly on a `TCPStore` (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU)
rather than through `init_process_group`, so it lives beside a `torchrun` job's default group
without touching it. The server hosts the store (it knows its own address); the trainer connects to
it. The order of the tensors is the one announced over HTTP (grpokit.rollout.wire.UpdateRequest):
broadcast follows it exactly, tensor by tensor.

Who may be rank 0. The store's port is open to whoever can reach the machine (a TCPStore listens on
every interface and lets any client list its keys, the group's id among them), so the group id is
no secret. The server therefore also hands the trainer a per-group secret over its authenticated
HTTP channel, and the first thing broadcast once the group forms is that secret: a member that
cannot send it is refused before any tensor is accepted, and the group is closed.
"""

from __future__ import annotations

import datetime
import hmac
import secrets
import uuid

import torch
import torch.distributed as dist

from grpokit.rollout.wire import DTYPES, TensorMeta

TRAINER, SERVER = 0, 1


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The server's side: a store on a free port of `host` (`store.port`)."""
    return dist.TCPStore(host, 0, world_size=2, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The trainer's side: the server's store."""
    return dist.TCPStore(host, port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


SECRET_BYTES = 32


def new_group_id() -> str:
    return uuid.uuid4().hex


def new_secret() -> str:
    """A per-group secret, hex: handed to the trainer over HTTP, proven over the group."""
    return secrets.token_hex(SECRET_BYTES)


class GroupRefused(PermissionError):
    """The group's other member did not prove the group's secret."""


class WeightGroup:
    """Both ends of the two-member group. Building it blocks until the other member joins (or
    `timeout_s` passes: RuntimeError), then the trainer proves `secret` and the server checks it
    (GroupRefused, the group closed, when it differs)."""

    def __init__(self, store: dist.Store, rank: int, backend: str, timeout_s: float, group_id: str, secret: str):
        self.rank, self.backend = rank, backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.PrefixStore(f"grpokit-weights/{group_id}", store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        else:
            raise ValueError(f"unknown weight-group backend {backend!r} (gloo or nccl)")
        self._handshake(bytes.fromhex(secret))

    def _handshake(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a weight-group secret is {SECRET_BYTES} bytes, got {len(secret)}")
        if self.rank == TRAINER:
            self._broadcast(torch.frombuffer(bytearray(secret), dtype=torch.uint8))
            return
        got = torch.zeros(SECRET_BYTES, dtype=torch.uint8, device=self.device)
        self._broadcast(got)
        if not hmac.compare_digest(bytes(got.cpu().tolist()), secret):
            self.close()
            raise GroupRefused("the member that joined the weight group did not know its secret: refused")

    def _broadcast(self, t: torch.Tensor) -> None:
        self.pg.broadcast([t], dist.BroadcastOptions()).wait()     # root rank 0: the trainer

    def send(self, tensors: list[torch.Tensor]) -> None:
        """The trainer's side: broadcast each tensor, in order."""
        for t in tensors:
            self._broadcast(t.detach().to(self.device).contiguous())

    def receive(self, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        """The server's side: the tensors `metas` announce, received in order."""
        out = []
        for m in metas:
            t = torch.empty(m.shape, dtype=DTYPES[m.dtype], device=self.device)
            self._broadcast(t)
            out.append((m.name, t))
        return out

    def close(self) -> None:
        """Release the group (best effort: the other member may be gone already)."""
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - nothing to do about a peer that already died
            pass
