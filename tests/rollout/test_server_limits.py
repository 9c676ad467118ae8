"""A rollout server under load and against clients that hold it: requests in flight and connections
bounded (503 at once, never a hang), idle and slow connections closed after the deadline, a
generation cancelled when its client leaves, and 32 concurrent clients x 20 requests each answered
exactly once."""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grpokit.rollout.base import GenerationCancelled, SamplingParams
from grpokit.rollout.hf import HFEngine
from grpokit.rollout.server import ServerLimits
from grpokit.models import load_model, load_tokenizer
from tests.fixtures import tiny_run_inputs
from tests.rollout.server_proc import ServerProcess, raw_request, request, served

KEY = "limits-key-0123456789abcdefghijkl"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("limits"))


def wait_for(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("lean", [True, False])
def test_a_set_stop_event_cancels_generation_at_the_next_token(setup, lean):
    _, model_dir, _, _ = setup
    model = load_model(model_dir, dtype="float32", device="cpu")
    engine = HFEngine(model, load_tokenizer(model_dir), lean=lean)
    stop = threading.Event()
    params = SamplingParams(n=2, max_new_tokens=6, ignore_eos=True)
    assert engine.generate([[1, 2]], params, torch.Generator().manual_seed(0), stop=stop).completion_ids.shape == (2, 6)
    stop.set()
    with pytest.raises(GenerationCancelled):
        engine.generate([[1, 2]], params, torch.Generator().manual_seed(0), stop=stop)


def test_a_generation_is_cancelled_when_its_client_leaves(setup):
    _, model_dir, _, _ = setup
    limits = ServerLimits(max_new_tokens=4000, max_batch_tokens=None, io_timeout_s=5)
    with served(model_dir, api_key=KEY, limits=limits) as (address, service, _):
        real = service.engine.generate
        seen = {"started": threading.Event(), "raised": None}

        def spy(*args, **kw):                  # the real engine, watched
            seen["started"].set()
            try:
                return real(*args, **kw)
            except BaseException as exc:
                seen["raised"] = exc
                raise

        service.engine.generate = spy
        body = json.dumps({"prompt_ids": [[1, 2, 3]] * 16, "params": {"n": 4, "max_new_tokens": 4000, "ignore_eos": True},
                           "seed": 1}).encode()
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert seen["started"].wait(30)
        sock.close()                           # the client leaves mid-generation
        assert wait_for(lambda: service.counts["cancelled"] == 1, 60)
        assert isinstance(seen["raised"], GenerationCancelled) and service.counts["generated"] == 0
        status, out, _ = request(address, "POST", "/generate", {"prompt_ids": [[1]], "params": {"n": 2, "max_new_tokens": 3}},
                                 key=KEY, timeout=30)   # the engine is free again
        assert status == 200 and len(out["completion_ids"]) == 2


def test_requests_past_the_in_flight_limit_get_503_at_once(setup):
    _, model_dir, _, _ = setup
    limits = ServerLimits(max_in_flight=2, io_timeout_s=10)
    with served(model_dir, api_key=KEY, limits=limits) as (address, service, httpd):
        release = threading.Event()
        real = service.engine.generate
        inside = threading.Semaphore(0)

        def held(*args, **kw):                 # two generations that wait until told to finish
            inside.release()
            release.wait(30)
            return real(*args, **kw)

        service.engine.generate = held
        body = {"prompt_ids": [[1, 2]], "params": {"n": 1, "max_new_tokens": 2}}
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(request, address, "POST", "/generate", body, key=KEY) for _ in range(2)]
            assert inside.acquire(timeout=30)  # the first holds the engine; the second waits for it in flight
            assert wait_for(lambda: service.engine_lock.locked())
            time.sleep(0.3)
            t0 = time.monotonic()
            status, out, headers = request(address, "GET", "/health", key=KEY, timeout=10)
            assert status == 503 and out["kind"] == "busy" and headers.get("Retry-After") == "1"
            assert time.monotonic() - t0 < 5   # answered at once, not queued
            release.set()
            assert [f.result(timeout=60)[0] for f in futs] == [200, 200]
        status, out, _ = request(address, "GET", "/health", key=KEY)
        assert status == 200 and out["requests"]["busy"] == 1 and out["requests"]["generated"] == 2


def test_connections_are_bounded_and_idle_or_slow_ones_closed_after_the_deadline(setup):
    _, model_dir, _, _ = setup
    limits = ServerLimits(max_connections=3, max_connections_per_address=3, io_timeout_s=1.0)
    with served(model_dir, api_key=KEY, limits=limits) as (address, service, httpd):
        host, port = address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(3)]
        assert wait_for(lambda: httpd.connections == 3)
        status, body = raw_request(address, b"GET /health HTTP/1.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
        assert status == 503 and "connections open" in body["error"]
        # idle connections are closed by the server after io_timeout_s; then it serves again
        assert wait_for(lambda: httpd.connections == 0, 10)
        for s in idle:
            assert s.recv(1) == b""             # closed from the server's side
            s.close()
        # a header that trickles in, a byte at a time, is cut off at the deadline with 408
        t0 = time.monotonic()
        status, body = raw_request(address, b"GET /health HTTP/1.1\r\n", trickle=b"X-Slow: " + b"a" * 60,
                                   trickle_every_s=0.1)
        assert status == 408 and "within 1 s" in body["error"] and time.monotonic() - t0 < 8
        status, out, _ = request(address, "GET", "/health", key=KEY)
        assert status == 200 and out["requests"]["refused_connections"] == 1


@pytest.mark.slow
def test_32_clients_x_8_requests_each_answered_exactly_once(setup, tmp_path):
    """Loopback, a server process over the tiny model, at most 4 requests in flight: every request
    is answered once with its n completions (503s retried by the client), the server generated each
    exactly once, and a sample re-asked alone gets the same answer (no answer crossed to another
    client). Prints p50/p99 latency (docs/rollout.md quotes it)."""
    _, model_dir, _, _ = setup
    clients, per_client = 32, 8
    with ServerProcess(model_dir, tmp_path / "server.log", api_key=KEY, args=("--max-in-flight", "4")) as srv:
        def client(c: int):
            rng = random.Random(c)
            out = []
            for i in range(per_client):
                body = {"prompt_ids": [[1 + c % 15, 1 + i % 15, 2]], "seed": c * 1000 + i,
                        "params": {"n": 1 + (c + i) % 3, "max_new_tokens": 6, "temperature": 1.0}}
                t0, busy = time.monotonic(), 0
                while True:
                    status, answer, _ = request(srv.address, "POST", "/generate", body, key=KEY, timeout=120)
                    if status != 503:
                        break
                    busy += 1
                    time.sleep(rng.uniform(0.005, 0.05))
                out.append((body, status, answer, time.monotonic() - t0, busy))
            return out

        t0 = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            results = [r for rs in pool.map(client, range(clients)) for r in rs]
        wall = time.monotonic() - t0
        assert len(results) == clients * per_client
        assert all(status == 200 for _, status, _, _, _ in results), {s for _, s, _, _, _ in results}
        for body, _, answer, _, _ in results:
            n = body["params"]["n"]
            assert len(answer["completion_ids"]) == n == len(answer["logprobs"]) == len(answer["finish_reason"])
        busy_seen = sum(b for *_, b in results)
        status, health, _ = request(srv.address, "GET", "/health", key=KEY)
        assert health["requests"]["generated"] == clients * per_client       # none lost, none generated twice
        busy = health["requests"]["busy"] + health["requests"]["refused_connections"]
        assert busy == busy_seen > 0                                           # every 503 reached its client
        for body, _, answer, _, _ in random.Random(0).sample(results, 16):    # answers belong to their requests
            status, again, _ = request(srv.address, "POST", "/generate", body, key=KEY)
            assert again["completion_ids"] == answer["completion_ids"] and again["logprobs"] == answer["logprobs"]
        lat = sorted(r[3] for r in results)
        p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
        print(f"\nrollout-server load: {clients} clients x {per_client} requests, max-in-flight 4: p50 {p50 * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms, {len(lat) / wall:.0f} requests/s, {busy_seen} answers 503 (retried)")


def test_a_server_process_reports_the_limits_it_enforces(setup, tmp_path):
    """`serve` applies its flags and sizes --max-batch-tokens from the model's KV cache per token
    (here the tiny model's, so the bound is large); a request past a limit is refused unserved."""
    from transformers import AutoConfig

    from grpokit.rollout.server import kv_bytes_per_token
    _, model_dir, _, _ = setup
    cfg = AutoConfig.from_pretrained(model_dir)
    per = kv_bytes_per_token(cfg, 4)
    assert per == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    with ServerProcess(model_dir, tmp_path / "server.log", api_key=KEY, args=("--max-new-tokens", "40")) as srv:
        status, health, _ = request(srv.address, "GET", "/health", key=KEY)
        lim = health["limits"]
        assert lim["max_new_tokens"] == 40 and lim["max_in_flight"] == 16 and lim["max_batch_tokens"] > 10_000
        body = {"prompt_ids": [[1, 2]], "params": {"n": 1, "max_new_tokens": 41}}
        status, out, _ = request(srv.address, "POST", "/generate", body, key=KEY)
        assert status == 400 and "--max-new-tokens" in out["error"]
        assert request(srv.address, "GET", "/health", key=KEY)[1]["requests"]["generated"] == 0


def test_one_address_cannot_take_every_connection(setup):
    _, model_dir, _, _ = setup
    limits = ServerLimits(max_connections=4, io_timeout_s=5.0)          # 2 per address
    with served(model_dir, api_key=KEY, limits=limits) as (address, service, httpd):
        host, port = address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(2)]
        try:
            assert wait_for(lambda: httpd.connections == 2)
            status, body = raw_request(address, b"GET /health HTTP/1.1\r\n\r\n")
            assert status == 503 and httpd.counts["refused_connections"] == 1
        finally:
            for s in idle:
                s.close()
        assert wait_for(lambda: httpd.connections == 0, 15)
        assert request(address, "GET", "/health", key=KEY)[0] == 200
