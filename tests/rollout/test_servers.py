"""Several rollout servers behind one engine (grpokit.rollout.servers): the split by speed, the same
completions however the prompts are split, a server dropped mid-run and taken back with the current
weights. The servers run in threads of the test process (tests/rollout/server_proc.py), so one can
be stopped and started again on its port at a chosen moment."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from grpokit.config import load_config
from grpokit.models import load_model, load_tokenizer
from grpokit.rollout.base import PromptStreams, SamplingParams
from grpokit.rollout.client import RolloutServerError
from grpokit.rollout.hf import HFEngine
from grpokit.rollout.server import tensor_checksum
from grpokit.rollout.servers import ServerPool, split_by_rate
from tests.fixtures import small_overrides, tiny_run_inputs, varied_trainer
from tests.rollout.server_proc import served
from tests.train import torchrun


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("servers"))


def test_prompts_are_split_by_speed_summing_to_the_whole():
    assert split_by_rate(10, [1.0, 1.0]) == [5, 5]
    assert split_by_rate(10, [3.0, 1.0]) == [8, 2]            # 7.5 / 2.5: the tie goes to the earlier
    assert split_by_rate(3, [1.0, 1.0, 1.0, 1.0]) == [1, 1, 1, 0]
    assert split_by_rate(7, [0.2, 0.5, 0.3]) == [1, 4, 2]     # 1.4 / 3.5 / 2.1
    assert split_by_rate(0, [1.0, 2.0]) == [0, 0]


def test_completions_do_not_depend_on_which_server_draws_them(setup):
    _, model_dir, _, _ = setup
    model, tok = load_model(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [6], [7, 7, 7]]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    with served(model_dir) as (a, _, _), served(model_dir) as (b, _, _):
        pool = ServerPool([a, b], tok, timeout_s=60)
        outs = []
        for rates in ({a: 1.0, b: 1.0}, {a: 9.0, b: 1.0}, {a: 1.0, b: 4.0}):
            pool.rate, pool.measured = dict(rates), set(rates)
            outs.append(pool.generate(prompts, params, torch.Generator().manual_seed(4)))
        local = HFEngine(model, tok).generate(prompts, params, PromptStreams(
            torch.randint(0, 2**62, (len(prompts),), generator=torch.Generator().manual_seed(4)).tolist()))
        for out in outs:
            assert torch.equal(out.completion_ids, local.completion_ids)
            torch.testing.assert_close(out.sampler_logprobs, local.sampler_logprobs, atol=1e-5, rtol=0)
            assert out.prompt_ids == local.prompt_ids
        pool.close()


def test_a_failed_server_is_dropped_mid_run_and_taken_back_with_the_current_weights(setup):
    """One process, two servers. After step 1 server B stops; step 2's prompts all go to A (B is
    dropped when its request fails) and the run goes on; B starts again on its port (a new instance,
    the base weights); the next update gives it the trainer's weights and it generates again, with an
    equal share whatever speed it was last measured at."""
    _, model_dir, _, _ = setup
    with contextlib.ExitStack() as stack:
        a, svc_a, _ = stack.enter_context(served(model_dir))
        b_ctx = served(model_dir)
        b, svc_b, _ = b_ctx.__enter__()
        port_b = int(b.rsplit(":", 1)[1])
        tr = varied_trainer(setup, "pool", **{"rollout.engine": "server", "rollout.server": f"[{a}, {b}]",
                                              "rollout.server_timeout_s": 30, "rollout.server_retries": 1})
        m = tr.step()
        tr.step_idx += 1
        assert m["rollout/servers"] == 2 and svc_a.version == svc_b.version == 1
        assert svc_a.counts["generated"] > 0 and svc_b.counts["generated"] > 0
        tr.engine.rate[b] = tr.engine.rate[a] / 100              # B last measured slow: a share of 0 prompts
        b_ctx.__exit__(None, None, None)                         # B goes away
        m = tr.step()
        tr.step_idx += 1
        assert tr.engine.live() == [a] and m["rollout/servers"] == 1 and svc_a.version == 2
        b, svc_b, _ = stack.enter_context(served(model_dir, port=port_b))     # B again: version 0, base weights
        assert svc_b.version == 0
        m = tr.step()                                            # drawn on A; the update revives B
        tr.step_idx += 1
        assert m["rollout/servers"] == 2 and svc_b.version == svc_a.version == 3
        want = {n: tensor_checksum(t) for n, t in tr.worker.export_weights()}
        assert tr.engine.clients[b].checksums() == want == tr.engine.clients[a].checksums()
        before = svc_b.counts["generated"]
        tr.step()
        assert svc_b.counts["generated"] > before                # B generates again: a new instance is
        assert b in tr.engine.measured                           # measured afresh, not by its old rate
        tr.engine.close()


def test_with_no_server_left_the_run_stops_with_one_line(setup):
    _, model_dir, _, _ = setup
    tok = load_tokenizer(model_dir)
    with served(model_dir) as (a, _, _):
        b_ctx = served(model_dir)
        b, _, _ = b_ctx.__enter__()
        pool = ServerPool([a, b], tok, timeout_s=10, retries=1)
    b_ctx.__exit__(None, None, None)
    with pytest.raises(RolloutServerError, match=r"no rollout server is left of 2 \(.*\): every one failed"):
        pool.generate([[5, 6]], SamplingParams(n=2, max_new_tokens=3), torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_and_two_servers_go_on_when_one_stops_and_resync_it(setup, tmp_path):
    """2 FSDP2 ranks and 2 servers: server B stops after step 2 and starts again (a new instance)
    two steps later; the run goes on on A alone meanwhile, takes B back with the current weights,
    and ends with both servers holding the final version."""
    _, model_dir, train, _ = setup
    run, out = tmp_path / "run", tmp_path / "out"
    steps = 14
    with served(model_dir) as (a, svc_a, _):
        b_ctx = served(model_dir)
        b, svc_b, _ = b_ctx.__enter__()
        port_b = int(b.rsplit(":", 1)[1])
        argv = ["train", *small_overrides(model_dir, train, run, **{
            "rewards": "[{name: digit_parity}]", "train.steps": steps, "train.distributed": "fsdp2",
            "train.dist_timeout_s": 60, "train.check_rewards": "false", "train.batch_advice": "false",
            "rollout.engine": "server", "rollout.server": f"[{a}, {b}]", "rollout.server_timeout_s": 30,
            "rollout.server_retries": 1})]
        proc = torchrun.start(2, torchrun.program("train_parity", out, *argv))
        try:
            def logged() -> int:
                f = run / "metrics.jsonl"
                return len(f.read_text().splitlines()) if f.exists() else 0

            deadline = time.monotonic() + 200
            while logged() < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            b_ctx.__exit__(None, None, None)                     # B stops after step 2
            stopped_at = logged()
            while logged() < stopped_at + 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            with served(model_dir, port=port_b) as (_, svc_b2, _):
                proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                assert proc.returncode == 0
                assert svc_a.version == svc_b2.version == steps
                assert svc_b2.counts["generated"] > 0           # taken back, and used
        finally:
            torchrun.kill_group(proc)
    assert [(out / f"rank{r}.exit").read_text() for r in (0, 1)] == ["0", "0"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    servers = [r["rollout/servers"] for r in rows]
    assert servers[0] == 2 and min(servers) == 1 and servers[-1] == 2


def test_the_pool_refuses_a_server_listed_twice():
    with pytest.raises(Exception, match="listed twice"):
        load_config(None, ["rollout.engine=server", "rollout.server=[127.0.0.1:9, 127.0.0.1:9]"])
