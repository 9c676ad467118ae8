"""Who gets into a rollout server: the API key on every endpoint, the refusal to serve a reachable
address unprotected, and the weight group's secret (a stranger who finds the group cannot join it
and change a tensor)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from grpokit import cli
from grpokit.errors import ConfigError
from grpokit.rollout import wire
from grpokit.rollout.client import ServerEngine
from grpokit.rollout.server import resolve_api_key, tensor_checksum
from grpokit.rollout.serving import check_bind, is_loopback, key_matches
from grpokit.rollout.weight_sync import TRAINER, WeightGroup, new_secret
from grpokit.models import load_tokenizer
from tests.fixtures import tiny_run_inputs
from tests.rollout.server_proc import request, served

KEY = "k3y-for-the-tests-0123456789abcdef"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("access"))


def _state(service) -> tuple:
    return service.version, service.instance, service.group, dict(service.counts), \
        {n: tensor_checksum(t) for n, t in service.engine.model.state_dict().items()}


# --------------------------------------------------------------------------------- binding

def test_loopback_is_told_from_reachable_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")
    assert not is_loopback("no-such-host.invalid")
    check_bind("127.0.0.1", None, insecure=False)                 # loopback: no key needed
    check_bind("0.0.0.0", KEY, insecure=False)
    check_bind("0.0.0.0", None, insecure=True)
    with pytest.raises(ConfigError, match="--insecure"):
        check_bind("0.0.0.0", None, insecure=False)
    with pytest.raises(ConfigError, match="at least 16"):
        check_bind("127.0.0.1", "short", insecure=False)


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("GRPOKIT_API_KEY", KEY)
    assert resolve_api_key(None) == KEY and resolve_api_key("other-key-0123456789") == "other-key-0123456789"
    monkeypatch.setenv("GRPOKIT_API_KEY", "")
    assert resolve_api_key(None) is None


def test_only_the_exact_bearer_key_matches():
    assert key_matches(f"Bearer {KEY}", KEY) and key_matches(f"bearer {KEY}", KEY)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Bearer  {KEY[1:]}"):
        assert not key_matches(header, KEY), header


def test_a_reachable_bind_without_a_key_refuses_to_start_with_one_line(setup, capsys, monkeypatch):
    _, model_dir, _, _ = setup
    monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    assert cli.main(["rollout-server", "--model", str(model_dir), "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: rollout-server: --host 0.0.0.0") and "API key" in err


# ------------------------------------------------------------------------------- endpoints

def test_every_endpoint_refuses_a_missing_or_wrong_key_and_nothing_changes(setup):
    _, model_dir, _, _ = setup
    with served(model_dir, api_key=KEY) as (address, service, httpd):
        meta = wire.describe(list(service.engine.model.state_dict().items()))
        calls = [("GET", "/health", None), ("GET", "/version", None), ("GET", "/version?wait=1", None),
                 ("GET", "/checksums", None),
                 ("POST", "/generate", {"prompt_ids": [[1, 2]], "params": {"n": 2, "max_new_tokens": 4}, "seed": 1}),
                 ("POST", "/init_weights_group", {"backend": "gloo", "timeout_s": 5}),
                 ("POST", "/update_weights", {"version": 7, "tensors": meta}),
                 ("POST", "/shutdown", None), ("GET", "/nowhere", None)]
        wrong = [None, "Bearer not-the-key-0123456789abcd", f"Basic {KEY}", KEY, f"Bearer {KEY}0"]
        before = _state(service)
        for method, path, body in calls:
            for auth in wrong:
                status, out, headers = request(address, method, path, body, headers={"Authorization": auth} if auth else {})
                assert status == 401 and out["kind"] == "unauthorized", (method, path, auth, status, out)
                assert headers.get("WWW-Authenticate") == "Bearer"
        assert _state(service) == before and service.group is None
        # the right key: the server was not stopped, and answers
        status, out, _ = request(address, "GET", "/health", key=KEY)
        assert status == 200 and out["version"] == 0 and out["requests"]["generated"] == 0


def test_a_trainer_without_the_key_is_told_in_one_line_and_one_with_it_trains(setup, monkeypatch):
    _, model_dir, _, _ = setup
    tok = load_tokenizer(model_dir)
    with served(model_dir, api_key=KEY) as (address, service, _):
        monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
        with pytest.raises(ConfigError, match="refused the trainer: missing API key.*GRPOKIT_API_KEY") as err:
            ServerEngine(address, tok, timeout_s=30, retries=1)
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="wrong API key"):
            ServerEngine(address, tok, timeout_s=30, retries=1, api_key="Bearer-wrong-key-0123456789")
        engine = ServerEngine(address, tok, timeout_s=30, retries=1, api_key=KEY)
        try:
            named = [(n, t + 0.01) for n, t in service.engine.model.state_dict().items()]
            engine.update_weights(named, version=3)
            assert service.version == 3
            assert engine.checksums() == {n: tensor_checksum(t) for n, t in named}
        finally:
            engine.close()


def test_the_training_run_reads_the_key_from_the_variable_its_config_names(setup, monkeypatch):
    from tests.fixtures import varied_trainer
    _, model_dir, _, _ = setup
    with served(model_dir, api_key=KEY) as (address, service, _):
        monkeypatch.setenv("MY_ROLLOUT_KEY", KEY)
        tr = varied_trainer(setup, "keyed", **{"rollout.engine": "server", "rollout.server": address,
                                              "rollout.server_timeout_s": 60, "rollout.server_retries": 1,
                                              "rollout.server_api_key_env": "MY_ROLLOUT_KEY"})
        tr.step()
        assert service.version == 1 and service.counts["generated"] >= 1


# ---------------------------------------------------------------------------- weight group

def test_a_stranger_cannot_join_the_weight_group_and_change_a_tensor(setup):
    _, model_dir, _, _ = setup
    with served(model_dir, api_key=KEY) as (address, service, _):
        before = _state(service)
        # without the key, no group is made at all
        status, _, _ = request(address, "POST", "/init_weights_group", {"backend": "gloo", "timeout_s": 10})
        assert status == 401 and service.joining is None
        # the trainer asks for a group; a stranger who can reach the store finds its id there ...
        status, out, _ = request(address, "POST", "/init_weights_group", {"backend": "gloo", "timeout_s": 10}, key=KEY)
        assert status == 200
        host = address.rsplit(":", 1)[0]
        store = dist.TCPStore(host, out["port"], world_size=2, is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        assert any(out["group_id"] in k for k in store.list_keys())      # the id is no secret
        # ... and joins first, as the trainer's rank, but cannot prove the group's secret
        sent = {}

        def stranger():
            try:
                g = WeightGroup(store, TRAINER, "gloo", 5, out["group_id"], new_secret())
                name, t = next(iter(service.engine.model.state_dict().items()))
                g.send([torch.full_like(t, 1234.0)])
                sent["ok"] = True
            except Exception as exc:  # noqa: BLE001 - the server hung up on it
                sent["error"] = exc

        t = threading.Thread(target=stranger, daemon=True)
        t.start()
        service.joining.join(timeout=30)
        t.join(timeout=30)
        assert service.group is None and "did not prove the group's secret" in service.join_error
        # the weights did not move, and an announced update finds no group
        status, body, _ = request(address, "POST", "/update_weights", {
            "version": 1, "tensors": wire.describe(list(service.engine.model.state_dict().items()))}, key=KEY)
        assert status == 409 and "did not prove the group's secret" in body["error"]
        assert _state(service)[0] == before[0] and _state(service)[4] == before[4]
        # the real trainer then forms its own group and syncs
        engine = ServerEngine(address, load_tokenizer(model_dir), timeout_s=30, retries=1, api_key=KEY)
        try:
            named = [(n, t * 0.5) for n, t in service.engine.model.state_dict().items()]
            engine.update_weights(named, version=1)
            assert service.version == 1 and engine.checksums() == {n: tensor_checksum(t) for n, t in named}
        finally:
            engine.close()


def test_a_stranger_in_the_server_s_seat_gets_no_weights():
    """The trainer joins a group whose other member does not know the secret: it is refused before
    any tensor is sent, and the stranger's side sees only nonces and proofs."""
    from grpokit.rollout.weight_sync import SERVER, GroupRefused, host_store, new_group_id

    store, gid = host_store("127.0.0.1", 20), new_group_id()
    seen = {}

    def stranger():
        try:
            WeightGroup(store, SERVER, "gloo", 10, gid, new_secret())
        except Exception as exc:  # noqa: BLE001 - refused or hung up on
            seen["error"] = exc

    t = threading.Thread(target=stranger, daemon=True)
    t.start()
    trainer_store = dist.TCPStore("127.0.0.1", store.port, world_size=2, is_master=False,
                                  timeout=datetime.timedelta(seconds=20))
    with pytest.raises(GroupRefused, match="rollout server did not prove"):
        WeightGroup(trainer_store, TRAINER, "gloo", 10, gid, new_secret())
    t.join(timeout=30)
    assert isinstance(seen.get("error"), (GroupRefused, RuntimeError))
