"""`grpokit rollout-server`: a rollout engine in a process of its own, driven by a trainer over HTTP.

A thin wrapper, not an inference server: it holds one engine (the transformers one, `--backend hf`,
or the in-process vLLM engine, `--backend vllm`) and answers small JSON requests. Completions go
back as token ids with their sampler log-probs; weights come in over a two-member
torch.distributed group (grpokit.rollout.weight_sync), announced first by name, shape and dtype.
The engine never generates while weights are being loaded into it, and every generation says which
weights version produced it. The HTTP front (the API key, request limits, deadlines, cancelling the
generation of a client that left) is grpokit.rollout.serving.

Endpoints (JSON bodies, grpokit.rollout.wire; all of them need the API key when one is set):
  GET  /health               instance id, weights version, backend, device, vocabulary size, request counts
  POST /generate             GenerateRequest -> GenerateResponse
  POST /init_weights_group   GroupRequest -> {"port", "group_id", "secret"}: join the store on that port
                             as rank 0 and prove the secret
  POST /update_weights       UpdateRequest: checked against the engine's tensors, which then follow over
                             the group; answered at once. An update may come in parts (buckets): no
                             generation runs between them (503, asked again), and the version is
                             loaded with the last part once the parts gave every parameter
  GET  /version[?wait=1]     {"version"}; with wait=1, once the update in progress is loaded (or failed)
  GET  /checksums            {"version", "checksums": {name: sha256 of the bytes}} of the engine's weights
  POST /shutdown             stop serving
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
import uuid

import torch

from grpokit.errors import ConfigError
from grpokit.rollout import wire
from grpokit.rollout.adapters import check_adapters
from grpokit.rollout.base import GenerationCancelled, NonFiniteLogits, PromptStreams, check_weights
from grpokit.rollout.serving import (API_KEY_ENV, RequestError, RolloutHTTPServer, ServerLimits, check_bind,
                                     is_loopback)
from grpokit.rollout.weight_sync import SERVER, WeightGroup, host_store, new_group_id, new_secret

log = logging.getLogger("grpokit.rollout.server")

PART_TIMEOUT_S = 600.0
"""Longest wait for the next part of an update in parts; past it the update is abandoned."""

__all__ = ["RequestError", "RolloutService", "ServerLimits", "make_server", "serve", "tensor_checksum"]


class RolloutService:
    """The engine and its weights version; what the HTTP front (grpokit.rollout.serving) calls."""

    def __init__(self, engine, *, host: str, backend: str, model: str, device: str, vocab_size: int | None,
                 limits: ServerLimits | None = None):
        self.engine, self.host = engine, host
        self.limits = limits or ServerLimits()
        self.info = {"backend": backend, "model": model, "device": device, "vocab_size": vocab_size}
        self.instance = uuid.uuid4().hex        # a restarted server is another instance
        self.version = 0
        self.engine_lock = threading.Lock()     # generation and weight loading never overlap
        self.state_lock = threading.Lock()      # the group and the update in progress
        self.group: WeightGroup | None = None
        self.joining: threading.Thread | None = None
        self.join_error: str | None = None
        self.updating: threading.Thread | None = None
        self.update_error: str | None = None
        self.partial: dict | None = None        # an update in parts under way: version, next part, names, deadline
        self.broken: str | None = None          # why the weights are a mix of two versions (until a whole update)
        self.lora_base = False                  # the weights are a LoRA run's base (+ adapters): adapters may come alone
        self.counts = {"generated": 0, "cancelled": 0}
        self._count_lock = threading.Lock()
        self.routes = {
            "/health": {"GET": lambda h, q: self.health(h.server.counts)},
            "/version": {"GET": lambda h, q: self.wait_version(q.get("wait", ["0"])[0] == "1")},
            "/checksums": {"GET": lambda h, q: self.checksums()},
            "/generate": {"POST": self._generate},
            "/init_weights_group": {"POST": lambda h, q: self.init_group(
                _parse(wire.GroupRequest, h.read_json(), "init_weights_group request"))},
            "/update_weights": {"POST": lambda h, q: self.start_update(
                _parse(wire.UpdateRequest, h.read_json(), "update_weights request"))},
            "/shutdown": {"POST": self._shutdown},
        }

    def route(self, handler, method: str, path: str, query: dict):
        """Answer one authenticated request (grpokit.rollout.serving.Handler); None when answered already."""
        table = self.routes.get(path)
        if table is None:
            raise RequestError(404, f"no endpoint {path[:100]}", "not_found")
        if method not in table:
            raise RequestError(405, f"{method[:20]} {path} is not allowed (use {' or '.join(table)})",
                               "method_not_allowed")
        return table[method](handler, query)

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.counts[what] += 1

    # ----------------------------------------------------------------------------- requests
    def health(self, http_counts: dict | None = None) -> dict:
        return {"status": "ok", "instance": self.instance, "version": self.version,
                "group": self.group is not None, **self.info, "optional_weights": self._optional_weights(),
                "adapters": hasattr(self.engine, "load_adapters"),
                "eos_ids": [int(i) for i in getattr(self.engine, "eos_ids", None) or []],
                "requests": {**self.counts, **(http_counts or {})}, "limits": dataclasses.asdict(self.limits)}

    def _optional_weights(self) -> list[str]:
        """Tensors an update may leave out (a tied LM head, which is the embedding): a trainer does
        not send them."""
        expected = getattr(self.engine, "expected_weights", None)
        if expected is None:
            return []
        shapes, required = expected()
        return sorted(set(shapes) - set(required))

    def _generate(self, handler, query) -> dict:
        req = _parse(wire.GenerateRequest, handler.read_json(), "generate request")
        key, gone = handler.watch_client()
        try:
            return self.generate(req, stop=gone)
        finally:
            handler.server.watchdog.unwatch(key)

    def check_limits(self, req: wire.GenerateRequest) -> None:
        """RequestError (400) naming the limit a /generate request is over."""
        lim, p = self.limits, req.params
        completions = len(req.prompt_ids) * p.n
        longest = max(len(x) for x in req.prompt_ids)
        if completions > lim.max_completions:
            raise RequestError(400, f"{len(req.prompt_ids)} prompts x n={p.n} = {completions} completions is over "
                                    f"this server's {lim.max_completions} (--max-completions)", "too_large")
        if longest > lim.max_prompt_tokens:
            raise RequestError(400, f"a prompt of {longest} tokens is over this server's {lim.max_prompt_tokens} "
                                    "(--max-prompt-tokens)", "too_large")
        if p.max_new_tokens > lim.max_new_tokens:
            raise RequestError(400, f"params.max_new_tokens={p.max_new_tokens} is over this server's "
                                    f"{lim.max_new_tokens} (--max-new-tokens)", "too_large")
        positions = completions * (longest + p.max_new_tokens)
        if lim.max_batch_tokens is not None and positions > lim.max_batch_tokens:
            raise RequestError(400, f"the request needs {positions} cached token positions (completions x (longest "
                                    f"prompt + max_new_tokens)); this server takes {lim.max_batch_tokens} "
                                    "(--max-batch-tokens): send fewer prompts per request", "too_large")
        vocab = self.info["vocab_size"]
        if vocab is not None and max(max(x) for x in req.prompt_ids) >= vocab:
            raise RequestError(400, f"a prompt token id is >= the model's vocabulary size {vocab}")

    def generate(self, req: wire.GenerateRequest, stop: threading.Event | None = None) -> dict:
        """Generate for `req`; `stop` set (the client left) cancels it, at its next token where the
        engine can (`cancellable`), else once it is done; a cancelled generation answers nothing."""
        self.check_limits(req)
        dev = torch.device(self.info["device"])
        if req.stream_seeds is not None:
            if not getattr(self.engine, "prompt_streams", False):
                raise RequestError(400, f"this server's backend ({self.info['backend']}) cannot sample one stream "
                                        "per prompt (stream_seeds); a data-parallel trainer needs --backend hf")
            gen = PromptStreams(req.stream_seeds, device=dev)
        else:
            gen = torch.Generator(device=dev).manual_seed(req.seed) if req.seed is not None else None
        cancellable = getattr(self.engine, "cancellable", False)
        with self.engine_lock:
            self._check_whole()
            version = self.version
            try:
                if stop is not None and stop.is_set():
                    raise GenerationCancelled("its client left while it waited")
                kw = {"stop": stop} if cancellable and stop is not None else {}
                rb = self.engine.generate(req.prompt_ids, req.params.params(), gen, **kw)
                if stop is not None and stop.is_set():
                    raise GenerationCancelled("its client left")
            except NonFiniteLogits as exc:
                raise RequestError(422, str(exc), "non_finite_logits") from None
            except GenerationCancelled as exc:
                self._count("cancelled")
                log.info("a generation was cancelled: %s", exc)
                raise RequestError(499, "the client went away", "cancelled") from None
        self._count("generated")
        lengths = rb.completion_mask.sum(-1).tolist()
        return {"completion_ids": [rb.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)],
                "logprobs": [rb.sampler_logprobs[i, :n].tolist() for i, n in enumerate(lengths)],
                "finish_reason": list(rb.finish_reason), "resampled": int(rb.resampled),
                "weights_version": version, "instance": self.instance}

    def init_group(self, req: wire.GroupRequest) -> dict:
        """Host a store and join the new group from a thread; the trainer joins it as rank 0 and
        proves the secret handed out here (grpokit.rollout.weight_sync)."""
        with self.state_lock:
            if self.updating is not None and self.updating.is_alive():
                raise RequestError(409, "a weight update is in progress")
            if self.joining is not None:
                self.joining.join()                  # a previous join finishes or times out first
            if self.group is not None:
                self.group.close()
                self.group = None
            store, gid, secret = host_store(self.host, req.timeout_s), new_group_id(), new_secret()
            self.join_error = None

            def join():
                try:
                    group = WeightGroup(store, SERVER, req.backend, req.timeout_s, gid, secret)
                except Exception as exc:  # noqa: BLE001 - reported to the trainer at its next update
                    self.join_error = f"the weight group did not form: {exc}"
                    log.error(self.join_error)
                    return
                self.group, self.store = group, store

            self.joining = threading.Thread(target=join, name="weight-group-join", daemon=True)
            self.joining.start()
            return {"port": store.port, "group_id": gid, "secret": secret}

    def _check_whole(self) -> None:
        """Called under the engine lock before a generation: refuse while the weights are between
        two versions (503 while an update in parts is under way, so the client asks again; 409 once
        one was abandoned)."""
        p = self.partial
        if p is not None and time.monotonic() > p["deadline"]:
            self.partial = None
            self.broken = (f"weights version {p['version']} arrived in part only (parts 0-{p['next'] - 1}, then "
                           "nothing): the weights are a mix of two versions until a whole update")
            log.error(self.broken)
        if self.broken is not None:
            raise RequestError(409, self.broken, "weights_broken")
        if self.partial is not None:
            raise RequestError(503, f"weights version {self.partial['version']} is being loaded in parts", "busy")

    def start_update(self, req: wire.UpdateRequest) -> dict:
        """Check the announced tensors against the engine's (names and shapes; refused whole, 400,
        before any moves), receive them over the group from a thread, then load them. A whole
        update (part 0, last) is loaded at once; parts are loaded as they come, in order, and the
        version changes with the last part once every parameter has been given."""
        expected = getattr(self.engine, "expected_weights", None)
        whole = req.part == 0 and req.last
        specs = {m: a.model_dump() for m, a in req.adapters.items()} if req.adapters is not None else None
        if not whole and not hasattr(self.engine, "load_part"):
            raise RequestError(400, f"this server's backend ({self.info['backend']}) loads a weight update in one "
                                    "part only: set rollout.sync_bucket_mb=0 on the trainer", "bad_weights")
        if specs is not None and not hasattr(self.engine, "load_adapters"):
            raise RequestError(400, f"this server's backend ({self.info['backend']}) takes full weights only, not "
                                    "LoRA adapters: set rollout.sync_adapters=false on the trainer", "bad_weights")
        if expected is not None:
            shapes, required = expected()
            try:
                if specs is not None:
                    check_adapters(((m.name, m.shape) for m in req.tensors), specs, shapes)
                else:
                    check_weights(((m.name, m.shape) for m in req.tensors), shapes, required if whole else set())
            except (KeyError, ValueError) as exc:
                msg = exc.args[0] if exc.args else str(exc)
                raise RequestError(400, f"weights version {req.version} not loaded: {msg}", "bad_weights") from None
        with self.state_lock:
            if self.joining is not None:
                self.joining.join()
            if self.group is None:
                raise RequestError(409, self.join_error or "no weight group: POST /init_weights_group first")
            if self.updating is not None and self.updating.is_alive():
                if whole or req.part == 0:
                    raise RequestError(409, "a weight update is in progress")
                self.updating.join()                 # the part before this one is still loading
            if whole and specs is not None and (not self.lora_base or self.broken is not None):
                raise RequestError(409, f"weights version {req.version}: adapters alone need the base weights first "
                                        "(sent as the parts of an update that ends with the adapters)", "no_adapter_base")
            if not whole:
                if req.part > 0 and self.update_error is not None:
                    raise RequestError(409, self.update_error, "update_failed")
                self._next_part(req, required if expected is not None else set())
            self.update_error = None
            group = self.group

            def receive():
                try:
                    named = group.receive(req.tensors)
                    with self.engine_lock:
                        if whole and specs is not None:
                            self.engine.load_adapters(named, specs)
                            self.version = req.version
                        elif whole:
                            self.engine.update_weights(named, version=req.version)
                            self.version, self.broken, self.partial = req.version, None, None   # any parts before: superseded
                            self.lora_base = req.base
                        else:
                            if req.part == 0:
                                self.lora_base = False
                            if specs is not None:
                                self.engine.load_adapters(named, specs)
                            else:
                                self.engine.load_part(named)
                            self._part_loaded(req)
                except Exception as exc:  # noqa: BLE001 - reported to the trainer by /version?wait=1
                    self.update_error = f"weights version {req.version} not loaded: {exc}"
                    if not whole or specs is not None:      # some tensors may have been loaded
                        self.partial, self.lora_base = None, False
                        self.broken = f"{self.update_error} (the weights are a mix of two versions until a whole update)"
                    log.error(self.update_error)

            self.updating = threading.Thread(target=receive, name="weight-update", daemon=True)
            self.updating.start()
            return {"receiving": len(req.tensors), "version": req.version}

    def _next_part(self, req: wire.UpdateRequest, required: set[str]) -> None:
        """Under the state lock: the part must follow the one before it (part 0 starts an update)."""
        p = self.partial
        if req.part == 0:
            self.partial = {"version": req.version, "next": 0, "names": set(), "required": required,
                            "deadline": time.monotonic() + PART_TIMEOUT_S, "base": req.base}
        elif p is None or p["version"] != req.version or p["next"] != req.part:
            want = "part 0" if p is None else f"part {p['next']} of version {p['version']}"
            raise RequestError(409, f"weights version {req.version} part {req.part} is out of order (expected {want})",
                               "bad_weights")
        elif req.base != p["base"]:
            raise RequestError(400, f"weights version {req.version} part {req.part}: base is {req.base} but part 0 "
                                    f"said {p['base']}", "bad_weights")
        names = self.partial["names"]
        if any(m.name in names for m in req.tensors):
            raise RequestError(400, f"weights version {req.version} part {req.part} repeats a tensor of an earlier "
                                    "part", "bad_weights")
        self.partial["deadline"] = time.monotonic() + PART_TIMEOUT_S

    def _part_loaded(self, req: wire.UpdateRequest) -> None:
        """Under the engine lock, a part loaded: the version changes with the last one, if complete."""
        p = self.partial
        p["names"].update(m.name for m in req.tensors)
        p["next"] = req.part + 1
        if not req.last:
            return
        self.partial = None
        missing = p["required"] - p["names"]
        if missing:
            raise ValueError(f"{len(missing)} parameters were in no part, e.g. {sorted(missing)[:3]}")
        self.version, self.broken, self.lora_base = req.version, None, p["base"]
        if hasattr(self.engine, "weights_version"):
            self.engine.weights_version = req.version

    def wait_version(self, wait: bool) -> dict:
        t = self.updating
        if wait and t is not None:
            t.join()
            if self.update_error is not None:
                raise RequestError(409, self.update_error, "update_failed")
        return {"version": self.version, "instance": self.instance}

    def checksums(self) -> dict:
        model = getattr(self.engine, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            raise RequestError(404, "this backend does not expose its weights")
        with self.engine_lock:
            sums = {n: tensor_checksum(t) for n, t in model.state_dict().items()}
        return {"version": self.version, "checksums": sums}

    def _shutdown(self, handler, query) -> None:
        handler.send_json(200, {"status": "stopping"})
        threading.Thread(target=handler.server.shutdown, daemon=True).start()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def _parse(model, body, what: str):
    try:
        return wire.parse(model, body, what)
    except wire.WireError as exc:
        raise RequestError(400, str(exc)) from None


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included), to compare two copies exactly."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def make_server(service: RolloutService, host: str, port: int, *, api_key: str | None = None) -> RolloutHTTPServer:
    """The HTTP server in front of `service` (not yet serving: call `serve_forever`), with the
    service's limits; `api_key`: required of every request when given."""
    return RolloutHTTPServer((host, port), service.route, limits=service.limits, api_key=api_key)


# --------------------------------------------------------------------------------- backends
def load_backend(backend: str, model_path: str, *, device: str = "auto", dtype: str = "auto"):
    """(engine, model config, device, bytes per weight) for `--backend`: the HF engine over its own
    copy of the model, or the in-process vLLM engine (grpokit.rollout.vllm, imported only here)."""
    from grpokit.models.hf import resolve_device

    dev = str(resolve_device(device))
    if backend == "hf":
        from grpokit.rollout.hf import HFEngine
        from grpokit.models import load_model, load_tokenizer

        model = load_model(model_path, dtype=dtype, device=dev)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        engine = HFEngine(model, load_tokenizer(model_path), owns_weights=True)
        return engine, model.config, dev, next(model.parameters()).element_size()
    if backend == "vllm":
        from transformers import AutoConfig

        from grpokit.models import load_tokenizer
        try:
            from grpokit.rollout.vllm import VLLMEngine       # imports vLLM itself only when built
            engine = VLLMEngine(str(model_path), load_tokenizer(model_path), dtype=dtype)
        except ImportError as exc:
            raise ConfigError(f"--backend vllm is not available here ({exc}); install grpokit[vllm] "
                              "or use --backend hf") from None
        return engine, AutoConfig.from_pretrained(model_path), dev, 2
    raise ConfigError(f"unknown --backend {backend!r} (hf or vllm)")


def kv_bytes_per_token(config, elem_bytes: int) -> int | None:
    """Bytes of KV cache one token position takes (keys and values of every layer); None when the
    config does not say."""
    text = getattr(config, "text_config", None) or config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if not (layers and kv and head_dim):
        return None
    return 2 * layers * kv * head_dim * elem_bytes


def default_batch_tokens(config, elem_bytes: int, device: str, share: float = 0.8) -> int | None:
    """Token positions whose KV cache fits `share` of the memory free now on `device`."""
    from grpokit.rollout.decoder import free_bytes

    per = kv_bytes_per_token(config, elem_bytes)
    if per is None:
        return None
    return max(1, int(share * free_bytes(torch.device(device)) // per))


def resolve_api_key(api_key: str | None) -> str | None:
    """`--api-key`, else the environment's GRPOKIT_API_KEY; None when neither is set (or empty)."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None


def serve(model_path: str, *, backend: str = "hf", host: str = "127.0.0.1", port: int = 8000,
          device: str = "auto", dtype: str = "auto", api_key: str | None = None, insecure: bool = False,
          limits: ServerLimits | None = None, say=print) -> None:
    """Load the engine and serve until POST /shutdown (or Ctrl-C). `port` 0 picks a free one; the
    first line printed names the address. `api_key` (else GRPOKIT_API_KEY) is required of every
    request; a non-loopback `host` refuses to start without one unless `insecure`."""
    key = resolve_api_key(api_key)
    check_bind(host, key, insecure)                          # before the model loads
    limits = limits or ServerLimits()
    engine, config, dev, elem = load_backend(backend, model_path, device=device, dtype=dtype)
    if limits.max_batch_tokens is None and backend == "hf":  # vLLM pages its own cache
        limits = dataclasses.replace(limits, max_batch_tokens=default_batch_tokens(config, elem, dev))
    service = RolloutService(engine, host=host, backend=backend, model=str(model_path), device=dev,
                             vocab_size=getattr(config, "vocab_size", None), limits=limits)
    httpd = make_server(service, host, port, api_key=key)
    access = "API key required" if key else ("no API key: loopback only" if is_loopback(host) else
                                             "no API key (--insecure): anyone who reaches the port can use it")
    say(f"grpokit rollout-server: listening on {host}:{httpd.server_address[1]} "
        f"(backend {backend}, device {dev}, model {model_path}; {access})", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        service.close()
