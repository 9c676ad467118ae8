"""`rollout.engine: server`: a `RolloutEngine` whose generation runs in a `grpokit rollout-server`
process (grpokit.rollout.server), possibly on another machine.

The engine holds its own weights (`owns_weights`): after every optimizer step the trainer's weights
are announced over HTTP and broadcast over the weight group (grpokit.rollout.weight_sync), and the
server acknowledges the version it loaded. Every completion comes back with the version of the
weights that generated it, so the driver can check how stale a batch is. `submit` starts a
generation in the background (what `rollout.async` overlaps with the update); `generate` waits for it.

Faults: a server that does not answer at start is a one-line ConfigError, and so is one that
refuses the API key (`Authorization: Bearer KEY`, grpokit.rollout.serving); a request that gets no
answer is retried `retries` times with back-off, then RolloutServerError stops the run (its last
checkpoint stays as it was; `--resume` with a restarted server pushes the weights again). A busy
server (503) is asked again with back-off for up to `timeout_s`. A server that was restarted behind
the trainer's back (another instance id) and any malformed response are errors too, never a silent
wrong result.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time

import torch

from grpokit.errors import ConfigError
from grpokit.rollout import wire
from grpokit.rollout.base import NonFiniteLogits, PromptStreams, RolloutBatch, SamplingParams
from grpokit.rollout.weight_sync import TRAINER, WeightGroup, connect_store

log = logging.getLogger("grpokit.rollout")

__all__ = ["KeyRefused", "RolloutServerError", "ServerEngine", "parse_address"]


class RolloutServerError(RuntimeError):
    """The rollout server failed, went away or answered nonsense; the message is one line."""


def parse_address(address: str) -> tuple[str, int]:
    """"HOST:PORT" -> (host, port); a ConfigError otherwise."""
    host, sep, port = str(address).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"rollout.server must look like HOST:PORT (got {address!r})")
    return host.strip("[]"), int(port)


class _Http:
    """JSON over HTTP with bounded retries of requests that got no answer or found the server busy."""

    def __init__(self, address: str, timeout_s: float, retries: int, api_key: str | None = None):
        self.address = address
        self.host, self.port = parse_address(address)
        self.timeout_s, self.retries = timeout_s, retries
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, method: str, path: str, body=None, *, tries: int | None = None) -> dict:
        tries = tries or self.retries
        last, attempt, busy_since = None, 0, None
        while True:
            try:
                return self._once(method, path, body)
            except _Busy as exc:                                    # answered 503: not a failed try
                busy_since = busy_since or time.monotonic()
                if time.monotonic() - busy_since > self.timeout_s:
                    raise RolloutServerError(f"rollout server {self.address}: {method} {path}: still busy after "
                                             f"{self.timeout_s:g} s ({exc})") from None
                time.sleep(0.05 + 0.45 * min(1.0, (time.monotonic() - busy_since) / 10))
                continue
            except (OSError, http.client.HTTPException) as exc:     # refused, reset, timed out
                last = exc
                attempt += 1
                log.warning("rollout server %s: %s %s got no answer (try %d of %d): %s",
                            self.address, method, path, attempt, tries, exc)
            if attempt >= tries:
                raise RolloutServerError(f"rollout server {self.address} did not answer {method} {path} after "
                                         f"{tries} tries ({type(last).__name__}: {last})")
            time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))

    def _once(self, method: str, path: str, body) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers=self.headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            out = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RolloutServerError(f"rollout server {self.address}: {method} {path}: HTTP {resp.status} "
                                     f"with a body that is not JSON") from None
        if not isinstance(out, dict):
            raise RolloutServerError(f"rollout server {self.address}: {method} {path}: the answer is not a JSON object")
        if resp.status != 200:
            msg = out.get("error", f"HTTP {resp.status}")
            if resp.status == 503:
                raise _Busy(msg)
            if resp.status == 401:
                raise KeyRefused(f"rollout server {self.address} refused the trainer: {msg}; give the trainer the "
                                 "server's key in the environment variable named by rollout.server_api_key_env "
                                 "(GRPOKIT_API_KEY by default)")
            if out.get("kind") == "non_finite_logits":
                raise NonFiniteLogits(msg)
            raise RolloutServerError(f"rollout server {self.address}: {method} {path}: {msg}")
        return out


class _Busy(Exception):
    """The server answered 503: asked again after a pause."""


class KeyRefused(RolloutServerError):
    """The server answered 401: the trainer's API key is missing or wrong."""


class InThread:
    """`fn(*args)` run in a daemon thread; `result()` waits for it and re-raises what it raised."""

    def __init__(self, fn, *args, name: str = "rollout-request"):
        self._out, self._exc = None, None
        self.done_at: float | None = None     # perf_counter() when `fn` returned or raised
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            self._out = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by result()
            self._exc = exc
        finally:
            self.done_at = time.perf_counter()

    def join(self) -> None:
        """Wait for `fn` to return or raise (what it raised stays for `result`)."""
        self._thread.join()

    def result(self):
        self._thread.join()
        if self._exc is not None:
            raise self._exc
        return self._out


class PendingRollout(InThread):
    """A generation in flight; `result()` waits for it and checks the answer."""

    def __init__(self, engine: "ServerEngine", prompt_ids: list[list[int]], params: SamplingParams, body: dict):
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        super().__init__(engine.http.call, "POST", "/generate", body)

    def result(self) -> RolloutBatch:
        return self.engine._batch(self.prompt_ids, self.params, super().result())


def tensor_bytes(named_tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in named_tensors)


def weight_parts(named_tensors, bucket_bytes: int):
    """(tensors, bytes, last) parts of about `bucket_bytes` (0: one part) from `named_tensors`, taken
    as it yields them: a part is handed on once the next tensor shows it is not the last, so at
    most one part and one tensor are held."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and bucket_bytes > 0 and size + n > bucket_bytes:
            yield bucket, size, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket, size, True


class ServerEngine:
    """Rollout engine client of a `grpokit rollout-server` at `address` ("HOST:PORT")."""

    owns_weights = True

    def __init__(self, address: str, tokenizer, *, device: torch.device | str = "cpu", timeout_s: float = 600.0,
                 retries: int = 3, api_key: str | None = None, sends_weights: bool = True,
                 bucket_mb: float = 512.0, adapters: bool = True):
        """`sends_weights`: this client joins the server's weight group and pushes the weights (one
        client per server does: rank 0 of a data-parallel job); the others only wait, after each
        update, until the server has loaded it. `bucket_mb`: weights go in parts of about this
        size (0: one part), so the trainer never holds more than one part beyond its own tensors.
        `adapters`: a LoRA run sends its adapters alone when the server can fold them in
        (`update_adapters`; the base goes once, first)."""
        self.http = _Http(address, timeout_s, retries, api_key)
        self.sends_weights, self.bucket_bytes = sends_weights, int(bucket_mb * 2**20)
        self.last_sync: dict[str, float] = {}
        self.barrier = None
        """Set by a data-parallel trainer (its process group's barrier): after each update every
        client waits there, so that no rank asks for a generation before the sender's push is loaded."""
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        try:
            health = self.http.call("GET", "/health")
        except KeyRefused as exc:
            raise ConfigError(str(exc)) from None
        except RolloutServerError as exc:
            raise ConfigError(f"rollout.server {address}: no rollout server answers there ({exc}); start one "
                              "with `grpokit rollout-server --model PATH --port PORT`") from None
        self.instance, self.version = health.get("instance"), health.get("version")
        self.vocab_size = health.get("vocab_size")
        eos = health.get("eos_ids")
        self.eos_ids = [int(i) for i in eos] if isinstance(eos, list) and eos else None
        """The tokens that end the server's generations (an episode's turn ends on one), or None
        (a server too old to say: the tokenizer's EOS is assumed)."""
        self.optional = set(health.get("optional_weights") or [])   # not sent: a tied LM head
        self.takes_adapters = adapters and bool(health.get("adapters"))
        self.base_sent = False                 # a LoRA run's base weights reached this server instance
        if not isinstance(self.instance, str) or not isinstance(self.version, int):
            raise RolloutServerError(f"rollout server {address}: malformed /health answer")
        if self.vocab_size is not None and len(tokenizer) > self.vocab_size:
            raise ConfigError(f"rollout.server {address} serves a model with {self.vocab_size} token ids but the "
                              f"trainer's tokenizer has {len(tokenizer)}: is it the same model?")
        trainer_cuda = torch.device(device).type == "cuda"
        backend = "nccl" if trainer_cuda and str(health.get("device", "")).startswith("cuda") else "gloo"
        self.group = self._join_group(backend) if sends_weights else None
        log.info("rollout server %s: %s backend on %s%s", address, health.get("backend"), health.get("device"),
                 f", weight group over {backend}" if sends_weights else " (weights pushed by another client)")

    def _join_group(self, backend: str) -> WeightGroup:
        out = self.http.call("POST", "/init_weights_group", {"backend": backend, "timeout_s": self.timeout_s})
        try:
            port, gid, secret = int(out["port"]), str(out["group_id"]), str(out["secret"])
        except (KeyError, TypeError, ValueError):
            raise RolloutServerError(f"rollout server {self.http.address}: malformed /init_weights_group answer") from None
        store = connect_store(self.http.host, port, self.timeout_s)
        group = WeightGroup(store, TRAINER, backend, self.timeout_s, gid, secret)
        self._store = store                    # the group needs its store alive
        return group

    # ---------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors, version: int | None = None) -> None:
        """Push the tensors as `version` (default: the last one + 1) and wait for the server to
        acknowledge it. They go in parts of about `bucket_mb`, each announced then broadcast, taken
        from `named_tensors` as it yields them (a sharded trainer gathers one tensor at a time), so
        at most one part is held here. A client that does not send weights consumes the iterator
        (its gathers are collective) and waits for the server to reach `version`."""
        self._push(named_tensors, None, version)

    def needs_base(self) -> bool:
        """Whether the next adapter update must send the base weights first (a sender that has not
        sent them to this server yet)."""
        return self.sends_weights and not self.base_sent

    def update_adapters(self, adapters: list, specs: dict[str, dict], base=None, version: int | None = None) -> None:
        """Push a LoRA run's adapters as `version` (grpokit.rollout.adapters) and wait for the
        acknowledgement. `base`: the base weights (an iterator, as `update_weights` takes them), sent
        first in parts when given; the adapters are then the update's last part. Every rank passes
        the same `base` (None or not: under FSDP2 its gathers are collective)."""
        if base is None and self.needs_base():
            raise RolloutServerError(f"rollout server {self.http.address}: adapters need the base weights first")
        self._push(base, (adapters, specs), version)

    def _push(self, stream, adapters: tuple[list, dict] | None, version: int | None) -> None:
        """One update: the tensors of `stream` in parts (full weights, or with `adapters` the base
        they fold into), then `adapters` (tensors, specs) as the last part; acknowledged, then the
        ranks meet at the barrier. A client that does not send consumes `stream` and waits."""
        version = self.version + 1 if version is None else int(version)
        t0, sent, parts = time.perf_counter(), 0, 0
        self._check_instance(self.http.call("GET", "/version"))
        if not self.sends_weights:
            for _ in stream or ():
                pass
            if self.barrier is not None:
                self.barrier()                       # the sender's push is acknowledged by now
            self._await_version(version)
        else:
            base = adapters is not None and stream is not None
            needed = ((n, t) for n, t in stream or () if n not in self.optional)
            for bucket, size, last in weight_parts(needed, self.bucket_bytes):
                self._send_part(bucket, version, parts, last=last and adapters is None, base=base)
                sent, parts = sent + size, parts + 1
            if adapters is not None:
                self._send_part(adapters[0], version, parts, last=True, base=base, adapters=adapters[1])
                sent, parts = sent + tensor_bytes(adapters[0]), parts + 1
            if not parts:
                raise RolloutServerError(f"rollout server {self.http.address}: a weight update with no tensors")
            self.acknowledge(version)
            self.base_sent = adapters is not None     # merged weights are no LoRA base
            if self.barrier is not None:
                self.barrier()
        self.version = version
        self.last_sync = {"time/sync": time.perf_counter() - t0, "sync/mb": sent / 2**20, "sync/parts": float(parts)}

    def acknowledge(self, version: int) -> None:
        """Wait until the server has loaded the update just sent, which must be `version`."""
        ack = self._check_instance(self.http.call("GET", "/version?wait=1"))
        if ack.get("version") != version:
            raise RolloutServerError(f"rollout server {self.http.address} acknowledged weights version "
                                     f"{ack.get('version')}, not {version}")

    def _send_part(self, named: list, version: int, part: int, *, last: bool, base: bool = False,
                   adapters: dict[str, dict] | None = None) -> None:
        body = {"version": version, "tensors": wire.describe(named)}
        if not (part == 0 and last):
            body.update(part=part, last=last)
        if base:
            body["base"] = True
        if adapters is not None:
            body["adapters"] = adapters
        self.http.call("POST", "/update_weights", body, tries=1)
        try:
            self.group.send([t for _, t in named])
        except RuntimeError as exc:
            raise RolloutServerError(f"rollout server {self.http.address}: the weight broadcast failed ({exc})") from None

    def _await_version(self, version: int) -> None:
        """Until the server holds `version` (pushed by another client), within `timeout_s`: at once
        after the barrier, else polled."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            v = self._check_instance(self.http.call("GET", "/version?wait=1")).get("version")
            if v == version:
                return
            if self.barrier is not None or time.monotonic() > deadline:
                raise RolloutServerError(f"rollout server {self.http.address} holds weights version {v}, and "
                                         f"version {version} did not arrive within {self.timeout_s:g} s")
            time.sleep(0.02)
    def _check_instance(self, answer: dict) -> dict:
        if answer.get("instance") != self.instance:
            raise RolloutServerError(
                f"rollout server {self.http.address} was restarted during the run (its weights are no longer "
                "the trainer's)")
        return answer

    def checksums(self) -> dict[str, str]:
        """sha256 per tensor of the server's weights (grpokit.rollout.server.tensor_checksum)."""
        return self.http.call("GET", "/checksums")["checksums"]

    # ---------------------------------------------------------------------------- generation
    def submit(self, prompt_ids: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> PendingRollout:
        """Start a generation in the background; the server's sampler is seeded from `generator`."""
        seed = None
        if isinstance(generator, PromptStreams):
            if len(generator) != len(prompt_ids):
                raise ValueError(f"{len(generator)} prompt streams for {len(prompt_ids)} prompts")
        elif generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        body = {"prompt_ids": [list(map(int, p)) for p in prompt_ids], "seed": seed,
                "params": {"n": params.n, "max_new_tokens": params.max_new_tokens,
                           "temperature": float(params.temperature), "top_p": float(params.top_p),
                           "top_k": params.top_k, "ignore_eos": params.ignore_eos,
                           "resample_threshold": params.resample_threshold}}
        if isinstance(generator, PromptStreams):
            body["stream_seeds"] = list(generator.seeds)
        return PendingRollout(self, prompt_ids, params, body)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        return self.submit(prompt_ids, params, generator).result()

    def _batch(self, prompt_ids, params: SamplingParams, out: dict) -> RolloutBatch:
        """The RolloutBatch of a /generate answer, refused unless it is exactly what was asked."""
        try:
            r = wire.parse(wire.GenerateResponse, {k: v for k, v in out.items() if k != "instance"}, "generate response")
        except wire.WireError as exc:
            raise RolloutServerError(f"rollout server {self.http.address}: {exc}") from None
        self._check_instance(out)
        N = len(prompt_ids) * params.n
        bad = None
        if len(r.completion_ids) != N:
            bad = f"{len(r.completion_ids)} completions for {len(prompt_ids)} prompts x {params.n}"
        elif max(len(c) for c in r.completion_ids) > params.max_new_tokens:
            bad = f"a completion is longer than max_new_tokens={params.max_new_tokens}"
        elif self.vocab_size is not None and max(max(c) for c in r.completion_ids) >= self.vocab_size:
            bad = f"a token id is >= the vocabulary size {self.vocab_size}"
        if bad:
            raise RolloutServerError(f"rollout server {self.http.address}: malformed generate response: {bad}")
        L = max(len(c) for c in r.completion_ids)
        ids = torch.full((N, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, L), dtype=torch.long)
        logps = torch.zeros((N, L), dtype=torch.float32)
        for i, (c, lp) in enumerate(zip(r.completion_ids, r.logprobs)):
            ids[i, :len(c)] = torch.tensor(c)
            mask[i, :len(c)] = 1
            logps[i, :len(c)] = torch.tensor(lp, dtype=torch.float32)
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(params.n)],
            completion_ids=ids, completion_mask=mask, sampler_logprobs=logps,
            finish_reason=list(r.finish_reason), completions=self.tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True),
            resampled=r.resampled, weights_version=r.weights_version)

    def release_memory(self) -> None:
        """Nothing here: the server's memory is its own."""

    def resume_memory(self) -> None:
        """Undo `release_memory`."""

    def close(self) -> None:
        """Leave the weight group (the server keeps running)."""
        if self.group is not None:
            self.group.close()
