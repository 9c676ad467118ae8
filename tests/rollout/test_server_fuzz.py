"""A fuzzed rollout server: 1,000 malformed or hostile requests from a seeded generator (bad JSON,
wrong types, huge or negative numbers, token ids out of range, oversized, truncated and slow
bodies, unknown fields, broken request lines), all with the right key, against a server in this
process on loopback. Each must be answered with a 4xx and a one-line error naming the problem,
the server must stay up with its state unchanged, and a normal request after them must be
answered exactly as the engine answers it directly."""

from __future__ import annotations

import copy
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grpokit.rollout import wire
from grpokit.rollout.base import SamplingParams
from grpokit.rollout.server import ServerLimits, tensor_checksum
from tests.fixtures import tiny_run_inputs
from tests.rollout.server_proc import raw_request, request, served

KEY = "fuzz-key-0123456789abcdefghijklmnop"
N_CASES = 1000
LIMITS = ServerLimits(max_body_bytes=32 * 1024, max_completions=64, max_prompt_tokens=48, max_new_tokens=16,
                      max_batch_tokens=2048, max_in_flight=8, max_connections=64, io_timeout_s=1.0)
VALID = {"prompt_ids": [[1, 2, 3], [4, 5]], "params": {"n": 2, "max_new_tokens": 4, "temperature": 1.0,
                                                       "top_p": 1.0, "top_k": 0, "ignore_eos": False}, "seed": 7}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("fuzz"))


def http(method: str, path: str, body: bytes, *, headers: dict | None = None, length: int | None = None) -> bytes:
    hdrs = {"Host": "x", "Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
            **({"Content-Length": str(len(body) if length is None else length)} if method == "POST" else {}),
            **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items() if v is not None)
    return head.encode("latin-1") + b"\r\n" + body


class Case:
    """One hostile request: raw bytes, how to send them, and what the answer must say."""

    def __init__(self, kind, data: bytes, statuses=(400,), names: tuple[str, ...] = (), shut_wr=False, trickle=b""):
        self.kind, self.data, self.statuses, self.names = kind, data, set(statuses), names
        self.shut_wr, self.trickle = shut_wr, trickle


def _post(path, obj, **kw) -> bytes:
    return http("POST", path, json.dumps(obj).encode(), **kw)


def cases(vocab: int, meta: list[dict], rng: random.Random) -> list[Case]:
    """The seeded list of N_CASES hostile requests."""
    wrong_values = ["x", [], {}, None, True, 1.5, -1, [["a"]], {"n": 1}]

    def wrong_type():
        body = copy.deepcopy(VALID)
        field = rng.choice(["prompt_ids", "params", "seed", "params.n", "params.max_new_tokens", "params.temperature",
                            "params.top_p", "params.top_k", "params.ignore_eos"])
        top, _, sub = field.partition(".")
        bad = {"prompt_ids": ["x", {}, 3, [[1.5]], [[True]], [["1"]], None],
               "params": ["x", [], 3, None], "seed": ["7", 1.5, [], True],
               "n": ["2", 2.0, None, []], "max_new_tokens": ["4", 4.5, None], "temperature": ["1", None, []],
               "top_p": ["1", None, {}], "top_k": ["0", 0.5, None], "ignore_eos": ["no", 0, None]}[sub or top]
        if sub:
            body[top][sub] = rng.choice(bad)
        else:
            body[top] = rng.choice(bad)
        return Case("wrong_type", _post("/generate", body), names=(top,))

    def bad_number():
        body = copy.deepcopy(VALID)
        field, value, name = rng.choice([
            ("n", rng.choice([0, -1, -2**63]), "params.n"), ("n", rng.choice([10**6, 2**64, 10**30]), "max-completions"),
            ("max_new_tokens", rng.choice([0, -5]), "params.max_new_tokens"),
            ("max_new_tokens", rng.choice([17, 10**9, 2**70]), "max-new-tokens"),
            ("temperature", rng.choice([-1.0, -1e308]), "params.temperature"),
            ("top_p", rng.choice([0.0, 1.5, -1.0, 1e300]), "params.top_p"),
            ("top_k", rng.choice([-1, 2**31, 2**80]), "params.top_k"),
            ("resample_threshold", rng.choice([0.0, 1.0, -3.0, 7.5]), "params.resample_threshold"),
            ("seed", rng.choice([-1, 2**63, 2**100]), "seed")])
        if field == "seed":
            body["seed"] = value
        else:
            body["params"][field] = value
        return Case("bad_number", _post("/generate", body), names=(name,))

    def bad_tokens():
        body = copy.deepcopy(VALID)
        choice = rng.randrange(6)
        if choice == 0:
            body["prompt_ids"][rng.randrange(2)].append(rng.choice([vocab, vocab + 1, 10**6, 2**63, 2**90]))
            return Case("tokens", _post("/generate", body), names=("vocabulary",))
        if choice == 1:
            body["prompt_ids"][0].append(rng.choice([-1, -(2**63)]))
            return Case("tokens", _post("/generate", body), names=("negative",))
        if choice == 2:
            body["prompt_ids"].append([])
            return Case("tokens", _post("/generate", body), names=("empty",))
        if choice == 3:
            body["prompt_ids"] = []
            return Case("tokens", _post("/generate", body), names=("prompt_ids",))
        if choice == 4:
            body["prompt_ids"] = [list(range(1, 50 + rng.randrange(200)))]
            return Case("tokens", _post("/generate", body), names=("max-prompt-tokens",))
        body["prompt_ids"] = [[1] * 40] * 30                              # 60 x (40 + 16) > 2048 positions
        body["params"]["max_new_tokens"] = 16
        return Case("tokens", _post("/generate", body), names=("max-batch-tokens",))

    def unknown_field():
        body = copy.deepcopy(VALID)
        name = rng.choice(["beam", "prompt", "__proto__", "n", "logprobs", "x" * 50])
        (body["params"] if rng.random() < 0.5 and name != "n" else body)[name] = rng.choice(wrong_values)
        if name == "n" and "n" in body["params"]:
            body["n"] = 3                                                  # "n" at the top level is unknown
        return Case("unknown_field", _post("/generate", body), names=(name[:20],))

    def missing_field():
        body = copy.deepcopy(VALID)
        del body[rng.choice(["prompt_ids", "params"])]
        return Case("missing_field", _post("/generate", body), names=("Field required",))

    def bad_json():
        valid = json.dumps(VALID).encode()
        choice = rng.randrange(8)
        if choice == 0:
            data = valid[:rng.randrange(1, len(valid) - 1)]                # cut short, announced as such
        elif choice == 1:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        elif choice == 2:
            data = b"[" * rng.choice([1000, 30000])                        # deep nesting
        elif choice == 3:
            data = valid.replace(b"1.0", rng.choice([b"NaN", b"Infinity", b"-Infinity"]), 1)
        elif choice == 4:
            data = b'{"prompt_ids": [[1]], "params": {}, "seed": "\xff\xfe"}'   # not UTF-8
        elif choice == 5:
            data = rng.choice([b"", b"null", b"[]", b"42", b'"text"', b"true"])
        elif choice == 6:
            data = b'{"prompt_ids": [[1]], "params": {"n": 1' + b"0" * 5000 + b"}}"   # a 5001-digit number
        else:
            data = valid + b"garbage"
        names = ("body",) if choice == 5 else ()
        return Case("bad_json", http("POST", "/generate", data), names=names)

    def oversized():
        if rng.random() < 0.5:
            return Case("oversized", http("POST", "/generate", b"{}", length=rng.choice([32 * 1024 + 1, 10**9, 10**30])),
                        statuses=(413,), names=("limit",))
        big = json.dumps({"prompt_ids": [[1] * 9000], "params": {}}).encode()
        big += b" " * (32 * 1024 + 1 - len(big))                           # sent whole, one byte over
        return Case("oversized", http("POST", "/generate", big), statuses=(413,), names=("limit",))

    def truncated():
        body = json.dumps(VALID).encode()
        cut = rng.randrange(0, len(body))
        return Case("truncated", http("POST", "/generate", body[:cut], length=len(body)), shut_wr=True,
                    statuses=(400, 408), names=("of",))

    def bad_headers():
        choice = rng.randrange(6)
        body = json.dumps(VALID).encode()
        if choice == 0:
            return Case("headers", http("POST", "/generate", body, headers={"Content-Length": None}), statuses=(411,),
                        names=("Content-Length",))
        if choice == 1:
            return Case("headers", http("POST", "/generate", body, headers={"Content-Length": rng.choice(["abc", "-5", "1e3", "0x10"])}),
                        names=("Content-Length",))
        if choice == 2:
            return Case("headers", http("POST", "/generate", body, headers={"Transfer-Encoding": "chunked"}),
                        statuses=(411,), names=("chunked",))
        if choice == 3:
            return Case("headers", http("POST", "/generate", body, headers={"Authorization": rng.choice(
                [None, "Bearer nope", f"Basic {KEY}", KEY])}), statuses=(401,), names=("API key",))
        if choice == 4:
            return Case("headers", http("POST", "/generate", body, headers={f"X-{i}": "v" for i in range(120)}),
                        statuses=(431,))
        return Case("headers", http("POST", "/generate", body, headers={"X-Long": "v" * 70000}), statuses=(400, 431))

    def bad_request_line():
        data = rng.choice([b"GARBAGE\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET / HTTP/1.1 extra\r\n\r\n",
                           b"\x00\x01\x02\r\n\r\n", b"GET " + b"/a" * 40000 + b" HTTP/1.1\r\n\r\n", b"GET /\r\n\r\n",
                           b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\nbroken header line\r\n\r\n{}"])
        return Case("request_line", data, statuses=(400, 401, 414, 431))

    def bad_route():
        method, path, status = rng.choice([("GET", "/generate", 405), ("DELETE", "/health", 405), ("PUT", "/shutdown", 405),
                                           ("GET", "/nowhere", 404), ("POST", "/../etc/passwd", 404),
                                           ("FOO", "/health", 405), ("GET", "/" + "a" * 3000, 404)])
        return Case("route", http(method, path, b"{}" if method != "GET" else b""), statuses=(status,))

    def bad_update():
        good = {"version": 1, "tensors": copy.deepcopy(meta)}
        choice = rng.randrange(8)
        names = ()
        if choice == 0:
            good["tensors"][rng.randrange(len(meta))]["dtype"] = rng.choice(["complex64", "float8", "", "int4"])
            names = ("dtype",)
        elif choice == 1:
            good["tensors"][rng.randrange(len(meta))]["shape"] = rng.choice([[-1], [2**40, 2**40], [1] * 9, ["3"]])
            names = ("shape",)
        elif choice == 2:
            good["tensors"].append(copy.deepcopy(good["tensors"][0]))
            names = ("twice",)
        elif choice == 3:
            name, names = rng.choice([("evil.weight", ("no tensor 'evil.weight'",)), ("", ("name",)),
                                      ("x" * 2000, ("name",))])
            good["tensors"][rng.randrange(len(meta))]["name"] = name
        elif choice == 4:
            t = good["tensors"][rng.randrange(len(meta))]
            t["shape"] = [s + 1 for s in t["shape"]] or [1]
            names = ("shape",)
        elif choice == 5:
            good["tensors"] = good["tensors"][1:]                          # the embedding: always required
            names = ("not sent",)
        elif choice == 6:
            good["version"] = rng.choice([-1, 2**62, "1", 1.5, None])
            names = ("version",)
        else:
            good["tensors"] = []
            names = ("tensors",)
        return Case("update", _post("/update_weights", good), names=names)

    def bad_group():
        body = rng.choice([{"backend": "mpi", "timeout_s": 5}, {"backend": "gloo", "timeout_s": 0},
                           {"backend": "gloo", "timeout_s": -1}, {"backend": "gloo", "timeout_s": 10**9},
                           {"backend": "gloo"}, {"backend": "gloo", "timeout_s": "5"}, {"backend": None, "timeout_s": 5},
                           {"backend": "gloo", "timeout_s": 5, "port": 1}])
        return Case("group", _post("/init_weights_group", body))

    makers = [wrong_type, bad_number, bad_tokens, unknown_field, missing_field, bad_json, oversized, truncated,
              bad_headers, bad_request_line, bad_route, bad_update, bad_group]
    out = [rng.choice(makers)() for _ in range(N_CASES - 12)]
    body = json.dumps(VALID).encode()                                    # slow senders: 12 of them
    for i in range(12):
        head = http("POST", "/generate", b"", length=len(body))
        out.append(Case("slow", head if i % 2 else head[:20], statuses=(408,), names=("within",),
                        trickle=body[:12] if i % 2 else head[20:40]))
    return out


def test_a_thousand_hostile_requests_leave_the_server_up_and_unchanged(setup):
    _, model_dir, _, _ = setup
    rng = random.Random(20261205)
    with served(model_dir, api_key=KEY, limits=LIMITS) as (address, service, httpd):
        meta = wire.describe(list(service.engine.model.state_dict().items()))
        todo = cases(service.info["vocab_size"], meta, rng)
        assert len(todo) == N_CASES
        before = (service.version, service.instance, dict(service.counts),
                  {n: tensor_checksum(t) for n, t in service.engine.model.state_dict().items()})

        def send(case: Case):
            return case, raw_request(address, case.data, shut_wr=case.shut_wr, trickle=case.trickle,
                                     trickle_every_s=0.15, timeout=30)

        fast = [c for c in todo if c.kind != "slow"]
        slow = [c for c in todo if c.kind == "slow"]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(send, fast)) + list(ThreadPoolExecutor(len(slow)).map(send, slow))
        problems = []
        kinds: dict[str, int] = {}
        for case, (status, body) in answers:
            kinds[case.kind] = kinds.get(case.kind, 0) + 1
            err = body.get("error", "")
            ok = (status in case.statuses and 400 <= status < 500 and isinstance(err, str) and err
                  and "\n" not in err and all(n in err for n in case.names))
            if not ok:
                problems.append(f"{case.kind}: {case.data[:120]!r} -> {status} {body}")
        assert not problems, f"{len(problems)} of {N_CASES} badly answered, e.g.:\n" + "\n".join(problems[:10])
        assert len(kinds) == 14, kinds
        # the server is up, and nothing in it changed
        after = (service.version, service.instance, dict(service.counts),
                 {n: tensor_checksum(t) for n, t in service.engine.model.state_dict().items()})
        assert after == before and service.group is None and service.joining is None
        assert httpd.connections == 0 or _settles(httpd)
        # a normal request is answered exactly as the engine answers it directly
        status, out, _ = request(address, "POST", "/generate", VALID, key=KEY)
        assert status == 200
        gen = torch.Generator().manual_seed(VALID["seed"])
        direct = service.engine.generate(VALID["prompt_ids"], SamplingParams(**VALID["params"]), gen)
        lengths = direct.completion_mask.sum(-1).tolist()
        assert out["completion_ids"] == [direct.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        assert len(out["completion_ids"]) == len(VALID["prompt_ids"]) * VALID["params"]["n"]


def _settles(httpd, wait_s: float = 10.0) -> bool:
    """The server's connection count returns to 0 (every handler thread ended)."""
    import time
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if httpd.connections == 0:
            return True
        time.sleep(0.05)
    return False
