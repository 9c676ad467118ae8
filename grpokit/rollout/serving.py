"""The rollout server's HTTP front (`grpokit rollout-server`): who gets in, and the limits that keep
one client from holding the server.

grpokit.rollout.server holds the engine and answers requests; this module receives them, over the
standard library's threading HTTP server, and decides which reach it:

- **A shared key.** With an API key set, every request must carry `Authorization: Bearer KEY`
  (compared in constant time); anything else is 401 before its body is read. A server bound to an
  address other machines can reach refuses to start without one unless told `insecure`
  (`check_bind`). The key is not a transport: there is no TLS (docs/rollout.md, "Running across
  machines").
- **Bounded work.** A request body over `max_body_bytes` is 413 unread; at most `max_in_flight`
  requests are served at once (the next is 503 at once, with Retry-After) and at most
  `max_connections` connections are open (the next gets 503 and is closed); generation sizes are
  bounded by the service (`ServerLimits`).
- **Deadlines.** A request (line, headers and body) must arrive within `io_timeout_s` of its first
  byte being awaited, however slowly it trickles (408 after that), and an answer that the client
  does not read within `io_timeout_s` is dropped. Idle keep-alive connections close after the same
  time.
- **Clients that leave.** While a generation runs, its client's socket is watched; when the client
  goes away the generation is cancelled at its next token (engines that support it, `cancellable`)
  or its result is dropped.

Every refusal is a JSON body `{"error": one line, "kind": ...}` with a 4xx status (503 when busy);
the connection is closed after it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from grpokit.errors import ConfigError

log = logging.getLogger("grpokit.rollout.server")

API_KEY_ENV = "GRPOKIT_API_KEY"
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of a rollout server (flags of `grpokit rollout-server`)."""
    max_body_bytes: int = 64 * 2**20
    """--max-body-mb: a request body larger than this is refused (413) without being read."""
    max_completions: int = 4096
    """--max-completions: prompts x n of one /generate."""
    max_prompt_tokens: int = 32768
    """--max-prompt-tokens: the longest prompt of a /generate."""
    max_new_tokens: int = 32768
    """--max-new-tokens: the largest `max_new_tokens` a /generate may ask for."""
    max_batch_tokens: int | None = None
    """--max-batch-tokens: completions x (longest prompt + max_new_tokens), what the KV cache of one
    /generate holds; None: no bound beyond the others (`serve` sets it from the model and memory)."""
    max_in_flight: int = 16
    """--max-in-flight: requests served at once; the next is answered 503 at once."""
    max_connections: int = 64
    """--max-connections: open connections; the next is answered 503 and closed."""
    max_connections_per_address: int | None = None
    """Open connections from one client address (None: half of `max_connections`), so that one
    client, with or without the key, cannot take every slot."""
    io_timeout_s: float = 30.0
    """--io-timeout: seconds to receive a whole request, and to send an answer."""

    def __post_init__(self):
        for name in ("max_body_bytes", "max_completions", "max_prompt_tokens", "max_new_tokens",
                     "max_in_flight", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout-server: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_connections_per_address is not None and self.max_connections_per_address < 1:
            raise ConfigError("rollout-server: max_connections_per_address must be >= 1")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ConfigError(f"rollout-server: max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if not self.io_timeout_s > 0:
            raise ConfigError(f"rollout-server: io_timeout_s must be > 0, got {self.io_timeout_s}")


class RequestError(Exception):
    """Answered with `status` and a one-line JSON error."""

    def __init__(self, status: int, message: str, kind: str = "bad_request"):
        super().__init__(message)
        self.status, self.kind = status, kind


# ------------------------------------------------------------------------------------ the key
def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback one (only this machine reaches it)."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_bind(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse (ConfigError) a server that other machines can reach and nothing protects, or a weak key."""
    if api_key is not None and len(api_key) < MIN_KEY_CHARS:
        raise ConfigError(f"rollout-server: the API key is {len(api_key)} characters; use at least {MIN_KEY_CHARS} "
                          "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if api_key is None and not insecure and not is_loopback(host):
        raise ConfigError(f"rollout-server: --host {host or '(all)'} can be reached from other machines; set an API "
                          f"key (--api-key or {API_KEY_ENV}) or pass --insecure to serve without one")


def key_matches(header: str | None, api_key: str) -> bool:
    """`Authorization: Bearer KEY` against the key, in constant time."""
    scheme, _, given = (header or "").strip().partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(given.strip().encode(), api_key.encode()) and ok_scheme


# ------------------------------------------------------------------------------- the watchdog
class _Deadline:
    __slots__ = ("sock", "at", "fired", "armed", "lock")

    def __init__(self, sock: socket.socket, at: float, lock: threading.Lock):
        self.sock, self.at, self.fired, self.armed, self.lock = sock, at, False, True, lock

    def disarm(self) -> bool:
        """Stop the clock; False when it had fired already (the request is late, whatever was read)."""
        with self.lock:
            self.armed = False
            return not self.fired


class Watchdog:
    """One thread for every connection: shuts the reading side of a socket whose request is late
    (its reads then end, and the handler answers 408), and sets the stop event of a generation whose
    client has gone."""

    def __init__(self, period_s: float = 0.1):
        self.period_s = period_s
        self._lock = threading.Lock()
        self._deadlines: set[_Deadline] = set()
        self._watched: dict[int, tuple[socket.socket, threading.Event]] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-server-watchdog", daemon=True)
        self._thread.start()

    def arm(self, sock: socket.socket, seconds: float) -> _Deadline:
        d = _Deadline(sock, time.monotonic() + seconds, self._lock)
        with self._lock:
            self._deadlines.add(d)
        return d

    def watch(self, sock: socket.socket) -> tuple[int, threading.Event]:
        """An event set once `sock`'s peer has closed its side."""
        ev = threading.Event()
        with self._lock:
            key = id(ev)
            self._watched[key] = (sock, ev)
        return key, ev

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)

    def close(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.period_s):
            now = time.monotonic()
            with self._lock:                                   # fired and disarmed under one lock
                self._deadlines = {d for d in self._deadlines if d.armed}
                for d in [d for d in self._deadlines if d.at <= now]:
                    d.fired, d.armed = True, False
                    try:
                        d.sock.shutdown(socket.SHUT_RD)
                    except OSError:
                        pass
                watched = list(self._watched.values())
            for sock, ev in watched:
                if not ev.is_set() and peer_closed(sock):
                    ev.set()


def peer_closed(sock: socket.socket) -> bool:
    """True when the other end has closed (a read would return end-of-file at once)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (select.POLLHUP | select.POLLERR):
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


# ------------------------------------------------------------------------------------- HTTP
def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


class Handler(BaseHTTPRequestHandler):
    """One connection. `route(handler, method, path, query)` of the server's service answers
    a request that passed the key, the gate and the body checks."""

    server: "RolloutHTTPServer"
    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"        # refusals of unparsable request lines get a status line

    def setup(self) -> None:
        t = self.server.limits.io_timeout_s                    # reads end at the watchdog's deadline first:
        self.timeout = t + max(1.0, t / 2)                     # the socket's own timeout is the backstop
        super().setup()

    def log_message(self, fmt, *args):                         # requests at debug level, not on stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # ------------------------------------------------------------------------ one request
    def handle_one_request(self) -> None:
        self.raw_requestline, self.requestline, self.command = b"", "", ""
        self._deadline = self.server.watchdog.arm(self.connection, self.server.limits.io_timeout_s)
        try:
            self._one_request()
        except TimeoutError:                                   # a read waited io_timeout_s for a byte
            if self.raw_requestline:
                self._late()
            else:                                              # an idle connection: closed without a word
                self.close_connection = True
        except (ConnectionError, BrokenPipeError):
            self.close_connection = True
        finally:
            self._deadline.disarm()

    def _one_request(self) -> None:
        self.raw_requestline = self.rfile.readline(65537)
        if not self.raw_requestline:
            self.close_connection = True                       # the client closed, or an idle connection timed out
            return
        if self._deadline.fired:
            return self._late()
        if len(self.raw_requestline) > 65536:
            self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
            return self._refuse(RequestError(414, "the request line is over 65536 bytes", "too_long"))
        if not self.parse_request():                           # answered by send_error
            return
        if self._deadline.fired:
            return self._late()
        if len(self.requestline.split()) < 3:                  # a bare "GET /" (HTTP/0.9)
            return self._refuse(RequestError(400, "HTTP/0.9 requests are not served: name HTTP/1.0 or HTTP/1.1"))
        self._dispatch()                                       # every method: an unknown one is 405 there

    def _late(self) -> None:
        self._refuse(RequestError(408, f"the request was not received within {self.server.limits.io_timeout_s:g} s",
                                  "timeout"))

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        srv = self.server
        try:
            if srv.api_key is not None and not key_matches(self.headers.get("Authorization"), srv.api_key):
                given = self.headers.get("Authorization")
                raise RequestError(401, "wrong API key" if given else "missing API key (send Authorization: Bearer KEY)",
                                   "unauthorized")
            if not srv.gate.acquire(blocking=False):
                srv.count("busy")
                raise RequestError(503, f"the server is serving {srv.limits.max_in_flight} requests already; "
                                        "try again shortly", "busy")
            try:
                out = srv.route(self, self.command, url.path, parse_qs(url.query))
            finally:
                srv.gate.release()
        except RequestError as exc:
            return self._refuse(exc)
        except Exception as exc:  # noqa: BLE001 - the engine failed: say so, keep serving
            log.exception("%s %s failed", self.command, url.path)
            return self._refuse(RequestError(500, f"{type(exc).__name__}: {exc}", "server_error"))
        if out is not None:
            self.send_json(200, out)

    # ------------------------------------------------------------------------ bodies
    def read_json(self):
        """The request's JSON body, read within the request's deadline; RequestError otherwise."""
        lim = self.server.limits
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "chunked bodies are not accepted: send Content-Length", "length_required")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise RequestError(411, "a request with a body needs a Content-Length header", "length_required")
        if not raw.strip().isdigit():
            raise RequestError(400, f"Content-Length is not a whole number: {raw[:40]!r}")
        n = int(raw)
        if n > lim.max_body_bytes:
            raise RequestError(413, f"request body of {n} bytes is over the {lim.max_body_bytes}-byte limit "
                                    "(--max-body-mb)", "too_large")
        try:
            data = self.rfile.read(n)
        except TimeoutError:
            data = b""
            self._deadline.fired = True
        on_time = self._deadline.disarm()                      # received (or not): the answer may take long
        if not on_time or (len(data) < n and self._deadline.at <= time.monotonic()):
            raise RequestError(408, f"the request body was not received within {lim.io_timeout_s:g} s "
                                    f"({len(data)} of {n} bytes)", "timeout")
        if len(data) < n:
            raise RequestError(400, f"truncated body: {len(data)} of the {n} bytes announced")
        try:
            return json.loads(data or b"null", parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:             # JSONDecodeError, UnicodeDecodeError, depth
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RequestError(400, f"the body is not JSON: {msg[:200]}") from None

    def watch_client(self):
        """(key, event): the event is set once this request's client has gone (Watchdog.unwatch(key))."""
        return self.server.watchdog.watch(self.connection)

    # ------------------------------------------------------------------------ answers
    def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if status != 200:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except (TimeoutError, OSError):                        # the client does not read, or left
            self.close_connection = True

    def _refuse(self, exc: RequestError) -> None:
        headers = {"Retry-After": "1"} if exc.status == 503 else {}
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        self.send_json(exc.status, {"error": str(exc), "kind": exc.kind}, headers)

    def send_error(self, code, message=None, explain=None):     # the standard library's refusals, as JSON
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        if code >= 500:                                        # 505 for "HTTP/9.9": the client's mistake
            code = 400
        self.send_json(code, {"error": str(text).splitlines()[0][:300], "kind": "bad_request"})


class RolloutHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most `limits.max_connections` of them; `route` answers requests."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128               # the listen backlog (the standard library's 5 overflows under load)

    def __init__(self, address, route, *, limits: ServerLimits, api_key: str | None):
        self.route, self.limits, self.api_key = route, limits, api_key
        self.gate = threading.BoundedSemaphore(limits.max_in_flight)
        self.watchdog = Watchdog()
        self._lock = threading.Lock()
        self.connections = 0
        self.by_address: dict[str, int] = {}
        self.counts = {"busy": 0, "refused_connections": 0}
        super().__init__(address, Handler)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def process_request(self, request, client_address):
        host = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        per = self.limits.max_connections_per_address or max(1, self.limits.max_connections // 2)
        with self._lock:
            full = self.connections >= self.limits.max_connections or self.by_address.get(host, 0) >= per
            if full:
                self.counts["refused_connections"] += 1
            else:
                self.connections += 1
                self.by_address[host] = self.by_address.get(host, 0) + 1
        if full:
            body = json.dumps({"error": "the server has as many connections open as it takes (from this address or "
                                        "in all); try again shortly", "kind": "busy"}).encode()
            try:                                               # on the accepting thread: nothing that waits
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                request.shutdown(socket.SHUT_WR)
                request.recv(65536)                            # what has arrived of the request: not a reset
            except OSError:                                    # BlockingIOError included: nothing more to wait for
                pass
            self.close_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        """Close as a well-behaved server does ("lingering close"): send FIN after the answer, then
        read and drop what the client still sends (a body never read, after a refusal) until it
        closes, for at most a second, so that closing does not reset the connection before the
        client has read the answer."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(0.25)
            deadline, got = time.monotonic() + 1.0, 0
            while got < 4 * 2**20 and time.monotonic() < deadline:
                chunk = request.recv(65536)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:
            pass
        self.close_request(request)

    def process_request_thread(self, request, client_address):
        host = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self.connections -= 1
                self.by_address[host] -= 1
                if not self.by_address[host]:
                    del self.by_address[host]

    def server_close(self) -> None:
        super().server_close()
        self.watchdog.close()
