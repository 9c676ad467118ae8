"""`grpokit rollout-server`: a rollout engine in a process of its own, driven by a trainer over HTTP.

A thin wrapper, not an inference server: it holds one engine (the transformers one, `--backend hf`,
or the in-process vLLM engine, `--backend vllm`) and answers small JSON requests with the standard
library's threading HTTP server. Completions go back as token ids with their sampler log-probs;
weights come in over a two-member torch.distributed group (grpokit.rollout.weight_sync), announced
first by name, shape and dtype. The engine never generates while weights are being loaded into it,
and every generation says which weights version produced it.

Endpoints (JSON bodies, grpokit.rollout.wire):
  GET  /health               instance id, weights version, backend, device, vocabulary size
  POST /generate             GenerateRequest -> GenerateResponse
  POST /init_weights_group   GroupRequest -> {"port", "group_id"}: join the store on that port as rank 0
  POST /update_weights       UpdateRequest: the tensors follow over the group; answered at once
  GET  /version[?wait=1]     {"version"}; with wait=1, once the update in progress is loaded (or failed)
  GET  /checksums            {"version", "checksums": {name: sha256 of the bytes}} of the engine's weights
  POST /shutdown             stop serving
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch

from grpokit.errors import ConfigError
from grpokit.rollout import wire
from grpokit.rollout.base import NonFiniteLogits
from grpokit.rollout.weight_sync import SERVER, WeightGroup, host_store, new_group_id

log = logging.getLogger("grpokit.rollout.server")
MAX_BODY = 64 * 2**20          # a generation request is token ids; weights never come over HTTP


class RequestError(Exception):
    """Answered with `status` and a one-line JSON error."""

    def __init__(self, status: int, message: str, kind: str = "bad_request"):
        super().__init__(message)
        self.status, self.kind = status, kind


class RolloutService:
    """The engine and its weights version; what the HTTP handlers call."""

    def __init__(self, engine, *, host: str, backend: str, model: str, device: str, vocab_size: int | None):
        self.engine, self.host = engine, host
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

    # ----------------------------------------------------------------------------- requests
    def health(self) -> dict:
        return {"status": "ok", "instance": self.instance, "version": self.version,
                "group": self.group is not None, **self.info}

    def generate(self, req: wire.GenerateRequest) -> dict:
        vocab = self.info["vocab_size"]
        if vocab is not None and max(max(p) for p in req.prompt_ids) >= vocab:
            raise RequestError(400, f"a prompt token id is >= the model's vocabulary size {vocab}")
        dev = torch.device(self.info["device"])
        gen = torch.Generator(device=dev).manual_seed(req.seed) if req.seed is not None else None
        with self.engine_lock:
            version = self.version
            try:
                rb = self.engine.generate(req.prompt_ids, req.params.params(), gen)
            except NonFiniteLogits as exc:
                raise RequestError(422, str(exc), "non_finite_logits") from None
        lengths = rb.completion_mask.sum(-1).tolist()
        return {"completion_ids": [rb.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)],
                "logprobs": [rb.sampler_logprobs[i, :n].tolist() for i, n in enumerate(lengths)],
                "finish_reason": list(rb.finish_reason), "resampled": int(rb.resampled),
                "weights_version": version, "instance": self.instance}

    def init_group(self, req: wire.GroupRequest) -> dict:
        """Host a store and join the new group from a thread; the trainer joins it as rank 0."""
        with self.state_lock:
            if self.updating is not None and self.updating.is_alive():
                raise RequestError(409, "a weight update is in progress")
            if self.joining is not None:
                self.joining.join()                  # a previous join finishes or times out first
            if self.group is not None:
                self.group.close()
                self.group = None
            store, gid = host_store(self.host, req.timeout_s), new_group_id()
            self.join_error = None

            def join():
                try:
                    group = WeightGroup(store, SERVER, req.backend, req.timeout_s, gid)
                except Exception as exc:  # noqa: BLE001 - reported to the trainer at its next update
                    self.join_error = f"the weight group did not form: {exc}"
                    log.error(self.join_error)
                    return
                self.group, self.store = group, store

            self.joining = threading.Thread(target=join, name="weight-group-join", daemon=True)
            self.joining.start()
            return {"port": store.port, "group_id": gid}

    def start_update(self, req: wire.UpdateRequest) -> dict:
        """Receive the announced tensors over the group from a thread, then load them whole."""
        with self.state_lock:
            if self.joining is not None:
                self.joining.join()
            if self.group is None:
                raise RequestError(409, self.join_error or "no weight group: POST /init_weights_group first")
            if self.updating is not None and self.updating.is_alive():
                raise RequestError(409, "a weight update is in progress")
            self.update_error = None
            group = self.group

            def receive():
                try:
                    named = group.receive(req.tensors)
                    with self.engine_lock:
                        self.engine.update_weights(named, version=req.version)
                        self.version = req.version
                except Exception as exc:  # noqa: BLE001 - reported to the trainer by /version?wait=1
                    self.update_error = f"weights version {req.version} not loaded: {exc}"
                    log.error(self.update_error)

            self.updating = threading.Thread(target=receive, name="weight-update", daemon=True)
            self.updating.start()
            return {"receiving": len(req.tensors), "version": req.version}

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

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included), to compare two copies exactly."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --------------------------------------------------------------------------------- HTTP
class _Handler(BaseHTTPRequestHandler):
    service: RolloutService                       # set on the subclass made by `make_server`
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):            # requests at debug level, not on stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise RequestError(413, f"request body of {n} bytes is over the {MAX_BODY}-byte limit")
        try:
            return json.loads(self.rfile.read(n) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        svc = self.service
        try:
            if method == "GET" and url.path == "/health":
                out = svc.health()
            elif method == "GET" and url.path == "/version":
                out = svc.wait_version(query.get("wait", ["0"])[0] == "1")
            elif method == "GET" and url.path == "/checksums":
                out = svc.checksums()
            elif method == "POST" and url.path == "/generate":
                out = svc.generate(wire.parse(wire.GenerateRequest, self._body(), "generate request"))
            elif method == "POST" and url.path == "/init_weights_group":
                out = svc.init_group(wire.parse(wire.GroupRequest, self._body(), "init_weights_group request"))
            elif method == "POST" and url.path == "/update_weights":
                out = svc.start_update(wire.parse(wire.UpdateRequest, self._body(), "update_weights request"))
            elif method == "POST" and url.path == "/shutdown":
                self._send(200, {"status": "stopping"})
                threading.Thread(target=self.server.shutdown, daemon=True).start()
                return
            else:
                raise RequestError(404, f"no endpoint {method} {url.path}", "not_found")
        except wire.WireError as exc:
            self._send(400, {"error": str(exc), "kind": "bad_request"})
            return
        except RequestError as exc:
            self._send(exc.status, {"error": str(exc), "kind": exc.kind})
            return
        except Exception as exc:  # noqa: BLE001 - the engine failed: tell the trainer, keep serving
            log.exception("%s %s failed", method, url.path)
            self._send(500, {"error": f"{type(exc).__name__}: {exc}", "kind": "server_error"})
            return
        self._send(200, out)

    def do_GET(self):  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_POST(self):  # noqa: N802
        self._route("POST")


def make_server(service: RolloutService, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"service": service})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


# --------------------------------------------------------------------------------- backends
def load_backend(backend: str, model_path: str, *, device: str = "auto", dtype: str = "auto"):
    """(engine, vocab size, device) for `--backend`: the HF engine over its own copy of the model,
    or the in-process vLLM engine (grpokit.rollout.vllm, imported only here)."""
    from grpokit.models.hf import resolve_device

    dev = str(resolve_device(device))
    if backend == "hf":
        from grpokit.rollout.hf import HFEngine
        from grpokit.models import load_model, load_tokenizer

        model = load_model(model_path, dtype=dtype, device=dev)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return HFEngine(model, load_tokenizer(model_path), owns_weights=True), model.config.vocab_size, dev
    if backend == "vllm":
        from transformers import AutoConfig

        from grpokit.models import load_tokenizer
        try:
            from grpokit.rollout.vllm import VLLMEngine       # imports vLLM itself only when built
            engine = VLLMEngine(str(model_path), load_tokenizer(model_path), dtype=dtype)
        except ImportError as exc:
            raise ConfigError(f"--backend vllm is not available here ({exc}); install grpokit[vllm] "
                              "or use --backend hf") from None
        return engine, AutoConfig.from_pretrained(model_path).vocab_size, dev
    raise ConfigError(f"unknown --backend {backend!r} (hf or vllm)")


def serve(model_path: str, *, backend: str = "hf", host: str = "127.0.0.1", port: int = 8000,
          device: str = "auto", dtype: str = "auto", say=print) -> None:
    """Load the engine and serve until POST /shutdown (or Ctrl-C). `port` 0 picks a free one; the
    first line printed names the address."""
    engine, vocab, dev = load_backend(backend, model_path, device=device, dtype=dtype)
    service = RolloutService(engine, host=host, backend=backend, model=str(model_path), device=dev, vocab_size=vocab)
    httpd = make_server(service, host, port)
    say(f"grpokit rollout-server: listening on {host}:{httpd.server_address[1]} "
        f"(backend {backend}, device {dev}, model {model_path})", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        service.close()
