"""`rollout.engine: server`: the wire format, the server's HTTP handling, weight sync over the
weight group, staleness, and faults (an unreachable server, a malformed answer, a restarted server,
one killed mid-run and a resume with a restarted one).

Most tests run the server in a thread of the test process (`served`): the same HTTP and gloo code
paths as a separate process, without its start-up cost. The acceptance tests use a real second
process (`ServerProcess`, tests/rollout/server_proc.py), which is killed even when a test fails.
"""

from __future__ import annotations

import json
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from grpokit import cli
from grpokit.config import load_config
from grpokit.rollout import wire
from grpokit.rollout.client import RolloutServerError, ServerEngine
from grpokit.rollout.hf import HFEngine
from grpokit.rollout.server import tensor_checksum
from grpokit.train import build_trainer
from grpokit.train import checkpoint as ckpt_lib
from grpokit.models import load_model, load_tokenizer
from tests.fixtures import greedy_outputs, small_overrides, tiny_run_inputs, varied_trainer
from tests.rollout.server_proc import ServerProcess
from tests.rollout.server_proc import served as _served


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("server"))


@contextmanager
def served(model_dir: Path):
    """(address, service): a rollout server in a thread of this process (tests/rollout/server_proc.py)."""
    with _served(model_dir) as (address, service, _):
        yield address, service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(setup, name, address, **extra):
    return varied_trainer(setup, name, **{"rollout.engine": "server", "rollout.server": address,
                                          "rollout.server_timeout_s": 60, "rollout.server_retries": 2, **extra})


def _checksums(tr) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in tr.worker.export_weights()}


# ------------------------------------------------------------------------------------ the wire

@pytest.mark.parametrize("body, match", [
    ({"prompt_ids": [], "params": {}}, "prompt_ids"),
    ({"prompt_ids": [[1, 2], []], "params": {}}, "prompt 1 is empty"),
    ({"prompt_ids": [[1, -2]], "params": {}}, "negative token id"),
    ({"prompt_ids": [[1]], "params": {"temperature": -1}}, "params.temperature"),
    ({"prompt_ids": [[1]], "params": {"top_p": 0}}, "params.top_p"),
    ({"prompt_ids": [[1]], "params": {"n": "4"}}, "params.n"),
    ({"prompt_ids": [[1]], "params": {"n": 2, "beam": 3}}, "params.beam"),
    ({"prompt_ids": [["a"]], "params": {}}, "prompt_ids"),
    ([1, 2], "body"),
])
def test_a_malformed_generate_request_is_refused_naming_the_field(body, match):
    with pytest.raises(wire.WireError, match=match) as err:
        wire.parse(wire.GenerateRequest, body, "generate request")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("body, match", [
    ({"completion_ids": [[1, 2]], "logprobs": [[-0.1]], "finish_reason": ["eos"], "weights_version": 0}, "2 tokens but 1"),
    ({"completion_ids": [[1]], "logprobs": [[-0.1]], "finish_reason": ["eos", "eos"], "weights_version": 0}, "finish"),
    ({"completion_ids": [[1]], "logprobs": [[0.5]], "finish_reason": ["eos"], "weights_version": 0}, "<= 0"),
    ({"completion_ids": [[1]], "logprobs": [[-0.5]], "finish_reason": ["stop"], "weights_version": 0}, "finish_reason"),
    ({"completion_ids": [[1]], "logprobs": [[-0.5]], "finish_reason": ["eos"]}, "weights_version"),
])
def test_a_malformed_generate_response_is_refused(body, match):
    with pytest.raises(wire.WireError, match=match):
        wire.parse(wire.GenerateResponse, body, "generate response")


def test_update_metadata_is_checked_before_any_tensor_moves():
    ok = {"name": "w", "dtype": "float32", "shape": [2, 3]}
    assert wire.parse(wire.UpdateRequest, {"version": 1, "tensors": [ok]}, "u").tensors[0].shape == [2, 3]
    for tensors, match in [([ok, ok], "announced twice"), ([{**ok, "dtype": "complex64"}], "unknown dtype"),
                           ([{**ok, "shape": [-1]}], "negative"), ([], "tensors")]:
        with pytest.raises(wire.WireError, match=match):
            wire.parse(wire.UpdateRequest, {"version": 1, "tensors": tensors}, "update_weights request")
    assert wire.describe([("w", torch.zeros(2, 3, dtype=torch.bfloat16))]) == [
        {"name": "w", "dtype": "bfloat16", "shape": [2, 3]}]


# ------------------------------------------------------------------------------ HTTP handling

def test_the_server_refuses_bad_requests_with_one_line_errors(setup):
    import http.client
    _, model_dir, _, _ = setup
    with served(model_dir) as (address, service):
        host, port = address.split(":")

        def post(path, raw: bytes):
            c = http.client.HTTPConnection(host, int(port), timeout=30)
            c.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            out = r.status, json.loads(r.read())
            c.close()
            return out

        assert post("/generate", b"{not json")[0] == 400
        status, body = post("/generate", json.dumps({"prompt_ids": [[1]], "params": {"n": 0}}).encode())
        assert status == 400 and "params.n" in body["error"]
        status, body = post("/generate", json.dumps({"prompt_ids": [[10**6]], "params": {}}).encode())
        assert status == 400 and "vocabulary" in body["error"]
        assert post("/nowhere", b"{}")[0] == 404
        status, body = post("/update_weights", json.dumps({"version": 1, "tensors": [
            {"name": "w", "dtype": "float32", "shape": [1]}]}).encode())
        assert status == 400 and "not loaded" in body["error"] and "no tensor 'w'" in body["error"]
        meta = wire.describe(list(service.engine.model.state_dict().items()))     # the right tensors, no group
        status, body = post("/update_weights", json.dumps({"version": 1, "tensors": meta}).encode())
        assert status == 409 and "init_weights_group" in body["error"]


def test_an_unreachable_server_is_a_one_line_error_at_start(setup, capsys):
    root, model_dir, train, _ = setup
    address = f"127.0.0.1:{free_port()}"
    over = [f"{k}={v}" for k, v in {"rollout.engine": "server", "rollout.server": address, "rollout.server_retries": 1}.items()]
    args = ["train", *small_overrides(model_dir, train, root / "unreachable"), *over]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: rollout.server") and "no rollout server answers" in err and "\n" not in err


# ---------------------------------------------------------------------------------- weight sync

def test_sync_mode_samples_only_from_the_latest_weights_and_refuses_a_restarted_server(setup):
    _, model_dir, _, _ = setup
    with served(model_dir) as (address, service):
        tr = _trainer(setup, "sync_inproc", address)
        assert service.version == 0 and tr.engine.version == 0     # the trainer's weights, pushed at start
        for step in (1, 2):
            m = tr.step()
            tr.step_idx += 1
            assert m["rollout/staleness"] == 0.0 and service.version == step
        assert tr.engine.checksums() == _checksums(tr)
        assert m["rollout/logprob_diff_max"] < 1e-4                  # same numerics on both sides
        # a response that is not what was asked for is refused, never used
        real = service.generate
        service.generate = lambda req, stop=None: {**real(req), "completion_ids": real(req)["completion_ids"][:-1]}
        with pytest.raises(RolloutServerError, match="malformed"):
            tr.step()
        service.generate = lambda req, stop=None: {**real(req), "logprobs": [[0.7] * len(c) for c in real(req)["completion_ids"]]}
        with pytest.raises(RolloutServerError, match="malformed generate response"):
            tr.step()
        service.generate = real
        service.instance = "another"                                 # as if restarted behind our back
        with pytest.raises(RolloutServerError, match="was restarted"):
            tr.step()
        tr.engine.close()


def test_weights_of_another_architecture_are_refused_whole(setup, tmp_path):
    from tests.fixtures import tiny_model_dir
    other = tiny_model_dir(tmp_path / "other", hidden=48)
    _, model_dir, _, _ = setup
    with served(other) as (address, service):
        before = service.checksums()["checksums"]
        with pytest.raises(RolloutServerError, match="not loaded.*shape"):
            _trainer(setup, "other_arch", address)
        assert service.checksums()["checksums"] == before and service.version == 0


@pytest.mark.slow
def test_a_second_process_samples_exactly_as_the_trainer_after_a_step_and_a_sync(setup, tmp_path):
    """Acceptance: the HF backend in another process; after a training step and its weight sync,
    every tensor's checksum, the greedy completions and their sampler log-probs equal the trainer's."""
    _, model_dir, _, _ = setup
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        tr = _trainer(setup, "second_process", srv.address)
        start = tr.engine.checksums()
        m = tr.step()
        tr.step_idx += 1
        assert m["optim/grad_norm"] > 0
        after = tr.engine.checksums()
        assert after == _checksums(tr)                               # every tensor, bit for bit
        assert sum(after[n] != start[n] for n in after) >= len(after) // 2   # the step did move them
        tok_s, lp_s = greedy_outputs(tr.engine, tr)
        tok_t, lp_t = greedy_outputs(HFEngine(tr.model, tr.tokenizer), tr)
        assert torch.equal(tok_s, tok_t)
        torch.testing.assert_close(lp_s, lp_t, atol=1e-5, rtol=0)
        tr.engine.close()


# ---------------------------------------------------------------------------------------- faults

@pytest.mark.slow
def test_a_server_killed_mid_run_stops_it_with_its_checkpoint_and_resume_resyncs_a_restarted_one(setup, tmp_path, capsys):
    """Acceptance: kill the server process after step 2; the run stops at step 3 after bounded
    retries with one line naming the last checkpoint (exit status 1); `--resume` against a
    restarted server pushes the checkpoint's weights and finishes the run."""
    root, model_dir, train, _ = setup
    run = root / "killed"
    over = {"rollout.engine": "server", "rollout.server_retries": 2, "rollout.server_timeout_s": 60,
            "train.steps": 4, "train.save_every": 2, "optim.lr": 1e-2, "rewards": "[{name: test_varied}]"}
    with ServerProcess(model_dir, tmp_path / "a.log") as srv:
        cfg = load_config(None, small_overrides(model_dir, train, run, **over, **{"rollout.server": srv.address}))
        tr = build_trainer(cfg, health=False)

        def kill_after_step_2(step, metrics):
            if step == 2:
                srv.kill()

        with pytest.raises(RolloutServerError, match="did not answer"):
            tr.train(progress=kill_after_step_2)
        tr.engine.close()
    assert tr.step_idx == 2
    assert ckpt_lib.latest_checkpoint(run).name == "step_000002"
    assert ckpt_lib.load_state(ckpt_lib.latest_checkpoint(run))["step"] == 2
    with ServerProcess(model_dir, tmp_path / "b.log") as srv:           # a fresh server: the base weights
        args = ["train", *small_overrides(model_dir, train, run, **over, **{"rollout.server": srv.address})]
        assert cli.main(args + ["--resume"]) == 0
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]              # steps 3-4 after the resume, once each
        assert all(r["rollout/staleness"] == 0.0 for r in rows)
        final = ckpt_lib.latest_checkpoint(run)
        assert final.name == "step_000004"
        # the server holds exactly the weights of the final checkpoint
        tok = load_tokenizer(model_dir)
        probe = ServerEngine(srv.address, tok, timeout_s=60, retries=1)
        model = load_model(final, dtype="float32", device="cpu")
        assert probe.checksums() == {n: tensor_checksum(t) for n, t in model.state_dict().items()}
        probe.close()
    capsys.readouterr()


def test_the_cli_stops_with_one_line_and_exit_status_1_when_the_server_dies(setup, tmp_path, capsys, monkeypatch):
    root, model_dir, train, _ = setup
    run = root / "cli_dies"
    with served(model_dir) as (address, service):
        over = {"rollout.engine": "server", "rollout.server": address, "rollout.server_retries": 2,
                "train.steps": 3, "train.save_every": 1, "rewards": "[{name: test_varied}]"}
        from grpokit.train.run import Trainer
        real_step = Trainer.step

        def step_then_vanish(self):
            if self.step_idx == 1:                    # the server goes away before step 2's rollout
                service.instance = "gone"
                monkeypatch.setattr(service, "generate", lambda req, stop=None: (_ for _ in ()).throw(ConnectionError("gone")))
            return real_step(self)

        monkeypatch.setattr(Trainer, "step", step_then_vanish)
        assert cli.main(["train", *small_overrides(model_dir, train, run, **over)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: rollout server")
    assert "step_000001" in err[0] and "--resume" in err[0]


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None,
                    reason="vLLM is installed here: the vllm backend would start")
def test_the_vllm_backend_without_vllm_is_a_one_line_error(setup, capsys):
    _, model_dir, _, _ = setup
    assert cli.main(["rollout-server", "--model", str(model_dir), "--backend", "vllm", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "vllm" in err and "\n" not in err
