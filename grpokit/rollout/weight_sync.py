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
HTTP channel, and once the group forms each member proves it knows that secret without sending it
(a challenge and response both ways, HMAC-SHA256): a stranger in either seat is refused before any
tensor moves, and the group is closed.
"""

from __future__ import annotations

import datetime
import hashlib
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
    `timeout_s` passes: RuntimeError), then each proves to the other that it knows `secret`
    (GroupRefused, the group closed, when the other does not)."""

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
        """Each member proves it knows the secret without sending it: both send a random nonce,
        then an HMAC of the other's nonce under the secret (with its own role in it), and check the
        other's. A stranger in either seat learns nothing it could replay, and is refused before
        any tensor moves (GroupRefused on the side that finds it out; the other side's next
        collective then fails)."""
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a weight-group secret is {SECRET_BYTES} bytes, got {len(secret)}")
        mine = secrets.token_bytes(SECRET_BYTES)
        nonces = {}
        for root in (TRAINER, SERVER):
            nonces[root] = self._exchange(mine if root == self.rank else None, root)
        other = SERVER if self.rank == TRAINER else TRAINER

        def proof(role: int, nonce: bytes) -> bytes:
            return hmac.new(secret, b"grpokit-weights/" + bytes([role]) + nonce, hashlib.sha256).digest()

        proofs = {root: self._exchange(proof(self.rank, nonces[other]) if root == self.rank else None, root)
                  for root in (TRAINER, SERVER)}                # both sent before either is checked
        if not hmac.compare_digest(proofs[other], proof(other, nonces[self.rank])):
            self.close()
            who = "trainer" if other == TRAINER else "rollout server"
            raise GroupRefused(f"the weight group's {who} did not prove the group's secret: refused")

    def _exchange(self, data: bytes | None, root: int) -> bytes:
        """32 bytes broadcast from `root` (`data` on the root, None elsewhere)."""
        t = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
             else torch.zeros(SECRET_BYTES, dtype=torch.uint8)).to(self.device)
        self._broadcast(t, root)
        return bytes(t.cpu().tolist())

    def _broadcast(self, t: torch.Tensor, root: int = TRAINER) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([t], opts).wait()

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
