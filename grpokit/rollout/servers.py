"""`rollout.server: [HOST:PORT, ...]`: several rollout servers behind one engine.

Each server keeps its own client (grpokit.rollout.client.ServerEngine) and weight group. A
generation is split into contiguous runs of prompts, one per live server, sized by each server's
measured completions per second (equal at first), sent at once and put back together in order.
Every prompt samples from a stream of its own (seeded from the trainer's generator, or given by a
data-parallel trainer), so which server draws a prompt does not change its completions.

Faults. A server that fails a generation (no answer after its retries, a restart behind the
trainer's back, a malformed answer) is dropped and its prompts go to the others in the same call.
A weight update goes to every live server part by part (the trainer's tensors are read once); one
that fails it is dropped. Before each update the dropped servers are tried again: one that answers
(a new instance, or the same one) gets a new weight group and this update before it generates
again. With no server left the run stops with RolloutServerError (the trainer's command line then
names its last checkpoint). In a data-parallel job rank 0 sends the weights; the other ranks wait at
the barrier and then keep only the servers that hold the new version.
"""

from __future__ import annotations

import logging
import time

import torch

from grpokit.errors import ConfigError
from grpokit.rollout.base import NonFiniteLogits, PromptStreams, RolloutBatch, SamplingParams, concat_batches
from grpokit.rollout.client import InThread, KeyRefused, RolloutServerError, ServerEngine, tensor_bytes, weight_parts

log = logging.getLogger("grpokit.rollout")

__all__ = ["ServerPool", "split_by_rate"]


def split_by_rate(n: int, rates: list[float]) -> list[int]:
    """How many of `n` prompts each server takes: proportional to its rate, by largest remainders
    (ties to the earlier server), summing to `n`."""
    total = sum(rates)
    share = [n * r / total for r in rates]
    counts = [int(s) for s in share]
    for i in sorted(range(len(rates)), key=lambda i: (-(share[i] - counts[i]), i))[:n - sum(counts)]:
        counts[i] += 1
    return counts


class ServerPool:
    """A rollout engine over several `grpokit rollout-server`s (module docstring)."""

    owns_weights = True
    RATE_EMA = 0.5

    def __init__(self, addresses: list[str], tokenizer, *, sends_weights: bool = True, **client_options):
        if len(set(addresses)) != len(addresses):
            raise ConfigError(f"rollout.server lists a server twice: {addresses}")
        self.addresses, self.tokenizer = list(addresses), tokenizer
        self.sends_weights, self.options = sends_weights, client_options
        self.clients: dict[str, ServerEngine | None] = {a: self._connect(a) for a in addresses}  # all must answer at start
        self.rate = {a: 1.0 for a in addresses}          # completions per second, once measured
        self.measured: set[str] = set()
        self.pad_id = next(iter(self.clients.values())).pad_id
        self.eos_ids = next(iter(self.clients.values())).eos_ids
        if len({tuple(c.eos_ids or ()) for c in self.clients.values()}) > 1:
            raise ConfigError(f"rollout.server: the servers end generations on different tokens "
                              f"({ {a: c.eos_ids for a, c in self.clients.items()} }): are they the same model?")
        self.version = 0
        self.barrier = None                   # a data-parallel trainer's barrier (as ServerEngine's)
        self.last_sync: dict[str, float] = {}
        self.dropped_total = 0

    def _connect(self, address: str) -> ServerEngine:
        return ServerEngine(address, self.tokenizer, sends_weights=self.sends_weights, **self.options)

    def live(self) -> list[str]:
        return [a for a in self.addresses if self.clients[a] is not None]

    def _drop(self, address: str, why: BaseException | str) -> None:
        client, self.clients[address] = self.clients[address], None
        self.dropped_total += 1
        log.warning("rollout server %s dropped (%s); %d of %d left", address, str(why).splitlines()[0][:300],
                    len(self.live()), len(self.addresses))
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - it is being dropped for failing already
                pass

    def _none_left(self) -> RolloutServerError:
        return RolloutServerError(f"no rollout server is left of {len(self.addresses)} "
                                  f"({', '.join(self.addresses)}): every one failed")

    # ---------------------------------------------------------------------------- generation
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | PromptStreams | None = None) -> RolloutBatch:
        if isinstance(generator, PromptStreams):
            seeds = list(generator.seeds)
        elif generator is not None:
            seeds = torch.randint(0, 2**62, (len(prompt_ids),), generator=generator, device=generator.device).tolist()
        else:
            seeds = None
        todo = [(0, len(prompt_ids))]                         # [start, end) runs of prompts still to draw
        done: dict[int, RolloutBatch] = {}
        while todo:
            live = self.live()
            if not live:
                raise self._none_left()
            jobs = []
            for start, end in todo:
                counts = split_by_rate(end - start, [self.rate[a] for a in live])
                for a, k in zip(live, counts):
                    if k:
                        jobs.append((a, start, start + k))
                        start += k
            todo = []
            pending = []
            for a, s, e in jobs:
                streams = PromptStreams(seeds[s:e]) if seeds is not None else None
                pending.append((a, s, e, time.perf_counter(), self.clients[a].submit(prompt_ids[s:e], params, streams)))
            for a, s, e, t0, job in pending:
                try:
                    done[s] = job.result()
                except (KeyRefused, NonFiniteLogits):
                    raise                                     # not the server's fault: the run decides
                except RolloutServerError as exc:
                    if self.clients[a] is not None:
                        self._drop(a, exc)
                    todo.append((s, e))
                    continue
                r = (e - s) * params.n / max(job.done_at - t0, 1e-6)     # its own time, not the wait
                self.rate[a] = (1 - self.RATE_EMA) * self.rate[a] + self.RATE_EMA * r if a in self.measured else r
                self.measured.add(a)
        return concat_batches([done[s] for s in sorted(done)], self.pad_id)

    def submit(self, prompt_ids: list[list[int]], params: SamplingParams,
               generator: torch.Generator | PromptStreams | None = None) -> InThread:
        """`generate` in the background (what `rollout.async` overlaps with the update)."""
        if isinstance(generator, torch.Generator):          # drawn now, in the caller's order
            generator = PromptStreams(torch.randint(0, 2**62, (len(prompt_ids),), generator=generator,
                                                    device=generator.device).tolist())
        return InThread(self.generate, prompt_ids, params, generator, name="rollout-pool")

    # ---------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors, version: int | None = None) -> None:
        self._push(named_tensors, None, version)

    @property
    def takes_adapters(self) -> bool:
        return all(self.clients[a].takes_adapters for a in self.live())

    def needs_base(self) -> bool:
        """The sender's side: dropped servers that answer again are taken back now; true when a live
        server has not received the base weights of a LoRA run (`update_adapters` sends them)."""
        if not self.sends_weights:
            return False
        self._revive()
        return any(self.clients[a].needs_base() for a in self.live())

    def update_adapters(self, adapters: list, specs: dict[str, dict], base=None, version: int | None = None) -> None:
        """A LoRA run's adapters to every live server; those without the base get it first, in
        parts read once from `base` (grpokit.rollout.client.ServerEngine.update_adapters)."""
        self._push(base, (adapters, specs), version)

    def _push(self, stream, adapters: tuple[list, dict] | None, version: int | None) -> None:
        """One update to every live server, `stream` read once: full weights go to all of them; with
        `adapters` (tensors, specs), `stream` is the base and goes only to the servers without it,
        and the adapters go to all (after the base: as its last part). A server that fails is dropped."""
        version = self.version + 1 if version is None else int(version)
        t0, sent, parts = time.perf_counter(), 0, 0
        if not self.sends_weights:
            for _ in stream or ():
                pass
            if self.barrier is not None:
                self.barrier()
            self._keep_current(version)
        else:
            if adapters is None:
                self._revive()
            targets = self.live()
            if not targets:
                raise self._none_left()
            streamed = list(targets) if adapters is None else [a for a in targets if self.clients[a].needs_base()]
            if streamed and stream is None:
                raise RolloutServerError(f"rollout servers {', '.join(streamed)} need the base weights first")
            optional = set.intersection(*(self.clients[a].optional for a in streamed)) if streamed else set()
            needed = ((n, t) for n, t in stream or () if n not in optional)   # a tied LM head: not sent
            for bucket, size, last in weight_parts(needed, int(self.options.get("bucket_mb", 512.0) * 2**20)):
                for a in list(streamed):      # read to the end even with no receiver (the gathers are collective)
                    try:
                        self.clients[a]._send_part(bucket, version, parts, last=last and adapters is None,
                                                   base=adapters is not None)
                    except RolloutServerError as exc:
                        self._drop(a, exc)
                        streamed.remove(a)
                        targets.remove(a)
                sent, parts = sent + size, parts + 1
            if adapters is not None:
                for a in list(targets):
                    first = a in streamed
                    try:
                        self.clients[a]._send_part(adapters[0], version, parts if first else 0, last=True, base=first,
                                                   adapters=adapters[1])
                    except RolloutServerError as exc:
                        self._drop(a, exc)
                        targets.remove(a)
                sent, parts = sent + tensor_bytes(adapters[0]), parts + 1
            for a in targets:
                try:
                    self.clients[a].acknowledge(version)
                    self.clients[a].version, self.clients[a].base_sent = version, adapters is not None
                except RolloutServerError as exc:
                    self._drop(a, exc)
            if not self.live():
                raise self._none_left()
            if self.barrier is not None:
                self.barrier()
        self.version = version
        self.last_sync = {"time/sync": time.perf_counter() - t0, "sync/mb": sent / 2**20, "sync/parts": float(parts),
                          "rollout/servers": float(len(self.live()))}

    def _revive(self) -> None:
        """The sender's side: a dropped server that answers again gets a new client (and weight
        group); the update that follows gives it the current weights."""
        for a in self.addresses:
            if self.clients[a] is None:
                try:
                    self.clients[a] = self._connect(a)
                    self._unmeasured(a)
                    log.info("rollout server %s answers again: it gets the current weights", a)
                except (ConfigError, RolloutServerError, OSError) as exc:
                    log.debug("rollout server %s still does not answer: %s", a, exc)

    def _unmeasured(self, address: str) -> None:
        """A server taken back is a new instance: its speed is unknown again, so it takes the mean
        rate of the measured live servers (an equal share, as every server at the start) until its
        first generation measures it. Keeping the rate it had when it failed would starve it: a
        server whose share rounds to no prompts is never measured again."""
        known = [self.rate[x] for x in self.live() if x != address and x in self.measured]
        self.rate[address] = sum(known) / len(known) if known else 1.0
        self.measured.discard(address)

    def _keep_current(self, version: int) -> None:
        """The other ranks' side, after the barrier: keep the servers that hold `version` (a dropped
        one that holds it is taken back), drop the rest."""
        for a in self.addresses:
            client = self.clients[a]
            try:
                if client is None:
                    client = self._connect(a)
                v = client._check_instance(client.http.call("GET", "/version?wait=1", tries=1)).get("version")
            except (ConfigError, RolloutServerError, OSError) as exc:
                if self.clients[a] is not None:
                    self._drop(a, exc)
                continue
            if v == version:
                if self.clients[a] is None:
                    self._unmeasured(a)
                client.version, self.clients[a] = version, client
            elif self.clients[a] is not None:
                self._drop(a, f"it holds weights version {v}, not {version}")
        if not self.live():
            raise self._none_left()

    def checksums(self) -> dict[str, str]:
        return self.clients[self.live()[0]].checksums()

    def release_memory(self) -> None:
        """Nothing here: the servers' memory is their own."""

    def resume_memory(self) -> None:
        """Undo `release_memory`."""

    def close(self) -> None:
        for a in self.live():
            self.clients[a].close()
