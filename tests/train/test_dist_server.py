"""Data-parallel training with a rollout server: 2 ranks (FSDP2) and one `grpokit rollout-server`,
three processes (docs/distributed.md, "A rollout server"), on one launcher or as two machines.

Each rank sends its own groups to the server with their per-group seeds (`stream_seeds`), so the
completions are the ones the in-process engine draws; rank 0 pushes the weights in parts, every rank
gathering each tensor together (FSDP2), and every rank waits for the push at a barrier. Marked slow
and distributed like the other multi-process tests; every process is bounded in time and killed
when the test ends (tests/train/torchrun.py, tests/rollout/server_proc.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from grpokit.rollout.server import tensor_checksum
from tests.fixtures import small_overrides, tiny_run_inputs
from tests.rollout.server_proc import ServerProcess, request
from tests.train import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("dist_server_inputs"))


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(inputs, world: int, run_dir, out, *extra_argv, **over):
    _, model_dir, train, _ = inputs
    argv = ["train", *small_overrides(model_dir, train, run_dir, **{
        "rewards": "[{name: digit_parity}]", "optim.lr": 5e-2, "train.distributed": "fsdp2",
        "train.dist_timeout_s": 60, "train.check_rewards": "false", "train.batch_advice": "false", **over}),
        *extra_argv]
    torchrun.run(world, torchrun.program("train_parity", out, *argv), timeout=240)
    assert [(out / f"rank{r}.exit").read_text() for r in range(world)] == ["0"] * world
    return _rows(run_dir)


def test_two_ranks_with_a_server_train_as_in_process_and_resume_at_one(tmp_path, inputs):
    _, model_dir, _, _ = inputs
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        served = {"rollout.engine": "server", "rollout.server": srv.address, "rollout.server_timeout_s": 60,
                  "rollout.sync_bucket_mb": 0.05}                  # the tiny model goes in several parts
        run = tmp_path / "served"
        rows = _train(inputs, 2, run, tmp_path / "o1", **served, **{
            "train.steps": 3, "train.save_every": 1, "train.keep_last": 5})
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert request(srv.address, "GET", "/version")[1]["version"] == 3         # one version a step
        assert all(r["sync/parts"] > 1 and r["sync/mb"] > 0 for r in rows)

        # the server holds the trainer's weights, bit for bit (the sharded checkpoint, exported)
        from grpokit.cli import main
        from grpokit.models import load_model
        assert main(["export", str(run / "checkpoints" / "step_000003"), str(tmp_path / "plain")]) == 0
        plain = load_model(tmp_path / "plain", dtype="float32", device="cpu")
        sums = request(srv.address, "GET", "/checksums")[1]["checksums"]
        assert {n: sums[n] for n, _ in plain.named_parameters()} == {
            n: tensor_checksum(t) for n, t in plain.named_parameters()}

        # the same run with the in-process engine draws the same completions
        local = _train(inputs, 2, tmp_path / "local", tmp_path / "o2", **{"train.steps": 3})
        for a, b in zip(rows, local):
            assert a["reward/mean"] == b["reward/mean"] and a["completion/length_mean"] == b["completion/length_mean"]
            for k in ("loss/total", "optim/grad_norm"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)

        # resumed from step 2 at one process: the server is pushed step 2's weights, then step 3's
        resumed = tmp_path / "resumed"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(run / "checkpoints" / "step_000002", resumed / "checkpoints" / "step_000002")
        got = _train(inputs, 1, resumed, tmp_path / "o3", "--resume", **served, **{"train.steps": 3})
        assert [r["step"] for r in got] == [3]
        assert got[0]["reward/mean"] == rows[2]["reward/mean"]
        assert got[0]["loss/total"] == pytest.approx(rows[2]["loss/total"], rel=1e-4, abs=1e-6)
        assert request(srv.address, "GET", "/version")[1]["version"] == 3


def test_two_sharded_ranks_send_a_server_the_lora_adapters_alone(tmp_path, inputs):
    """LoRA on 2 FSDP2 ranks with a server: the base goes once (at the start, in parts), then every
    step sends the adapters alone, gathered from the shards by every rank together; the server's
    weights equal the checkpoint's adapters merged into the base, bit for bit."""
    _, model_dir, _, _ = inputs
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        run = tmp_path / "lora"
        rows = _train(inputs, 2, run, tmp_path / "o", **{
            "rollout.engine": "server", "rollout.server": srv.address, "rollout.server_timeout_s": 60,
            "rollout.sync_bucket_mb": 0.05, "lora.enabled": "true", "lora.rank": 4, "lora.reference": "copy", "optim.lr": 1e-2,
            "train.steps": 3, "train.save_every": 3})
        assert request(srv.address, "GET", "/version")[1]["version"] == 3
        assert [r["sync/parts"] for r in rows] == [1, 1, 1]             # the adapters alone, each step
        from grpokit.models.lora import load_adapter_model, merged_state_dict
        policy = load_adapter_model(run / "checkpoints" / "step_000003", dtype="float32", device="cpu", merge=False)
        want = merged_state_dict(policy)
        adapters = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n) / 2**20
        assert all(r["sync/mb"] == pytest.approx(adapters) for r in rows)
        sums = request(srv.address, "GET", "/checksums")[1]["checksums"]
        assert {n: sums[n] for n in want} == {n: tensor_checksum(t) for n, t in want.items()}


def test_two_ddp_ranks_with_a_server_run_one_step_off_policy(tmp_path, inputs):
    """`rollout.async` under DDP (the demo-task test below shards with FSDP2): each rank keeps its
    share of the next step in flight; the first batch is on-policy, every later one one step stale,
    and the server ends at one version per step."""
    _, model_dir, _, _ = inputs
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        rows = _train(inputs, 2, tmp_path / "run", tmp_path / "o", **{
            "rollout.engine": "server", "rollout.server": srv.address, "rollout.server_timeout_s": 60,
            "rollout.async": "true", "train.distributed": "ddp", "train.steps": 4})
        assert request(srv.address, "GET", "/version")[1]["version"] == 4
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(r["optim/grad_norm"] > 0 for r in rows)


def test_two_machines_and_a_server_train_checkpoint_and_resume_on_one(tmp_path, inputs):
    """The multi-node path on this machine: two torchrun launchers (`--nnodes 2`, one process each,
    c10d rendezvous on localhost) and a rollout server as a third process train 3 DDP steps (the
    other tests here shard with FSDP2) with a checkpoint every step; resumed from step 2 on one
    machine, step 3 repeats theirs."""
    _, model_dir, train, _ = inputs
    with ServerProcess(model_dir, tmp_path / "server.log") as srv:
        def argv(run_dir, *extra):
            return torchrun.program("train_parity", run_dir.with_name(run_dir.name + "_out"), "train", *small_overrides(
                model_dir, train, run_dir, **{"rewards": "[{name: digit_parity}]", "optim.lr": 5e-2,
                "train.distributed": "ddp", "train.dist_timeout_s": 60, "train.check_rewards": "false",
                "train.batch_advice": "false", "rollout.engine": "server", "rollout.server": srv.address,
                "rollout.server_timeout_s": 60, "train.steps": 3}), *extra)
        run = tmp_path / "nodes"
        torchrun.run_nodes(2, argv(run, "train.save_every=1", "train.keep_last=5"), timeout=240)
        assert [(tmp_path / "nodes_out" / f"rank{r}.exit").read_text() for r in (0, 1)] == ["0", "0"]
        rows = _rows(run)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert request(srv.address, "GET", "/version")[1]["version"] == 3
        ck = run / "checkpoints" / "step_000002"
        assert list(ck.glob("*.safetensors"))                            # DDP: the full copy, written by rank 0
        resumed = tmp_path / "one"
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(ck, resumed / "checkpoints" / "step_000002")
        torchrun.run_nodes(1, argv(resumed, "--resume"), timeout=240)
        assert (tmp_path / "one_out" / "rank0.exit").read_text() == "0"
        got = _rows(resumed)
        assert [r["step"] for r in got] == [3]
        assert got[0]["reward/mean"] == rows[2]["reward/mean"]            # the same completions
        assert got[0]["loss/total"] == pytest.approx(rows[2]["loss/total"], rel=1e-4, abs=1e-6)
        assert request(srv.address, "GET", "/version")[1]["version"] == 3


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory, demo_warm_dir):
    """The embedded demo's warm-started model (the session's, tests/conftest.py; read only here) and
    its task's files."""
    from grpokit.demo import DemoSettings
    from grpokit.tasks.arithmetic import ArithmeticTask

    root = tmp_path_factory.mktemp("demo")
    s = DemoSettings()
    task = ArithmeticTask(seed=s.seed, carry_frac=s.carry_frac, teacher_correct=s.teacher_correct, heldout=s.heldout)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in task.train_rows(4000, s.seed + 7)))
    (root / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in task.heldout_rows()))
    return root, demo_warm_dir


def test_two_processes_with_a_server_one_step_off_policy_teach_the_demo_task(tmp_path, demo_inputs):
    """The demo's GRPO settings on 2 FSDP2 ranks (each samples half of the 16 groups per step) with
    their groups generated by a rollout server one step off policy (`rollout.async`): every batch
    after the first is one step stale, corrected by the importance weights, and held-out greedy
    accuracy rises as in the single-process demo."""
    root, warm = demo_inputs
    run_dir = tmp_path / "run"
    with ServerProcess(warm, tmp_path / "server.log") as srv:
        torchrun.run(2, ["-m", "grpokit", "train", "demo", f"model.path={warm}", f"data.path={root / 'train.jsonl'}",
                         f"data.eval_path={root / 'heldout.jsonl'}", f"train.run_dir={run_dir}", "train.steps=30",
                         "rollout.engine=server", f"rollout.server={srv.address}", "rollout.async=true",
                         "rollout.server_timeout_s=120", "train.eval_every=0", "train.save_every=0",
                         "train.save_every_minutes=0", "train.progress=false", "train.sample_every=0",
                         "train.check_rewards=false", "train.dist_timeout_s=120"], timeout=300)
        assert request(srv.address, "GET", "/version")[1]["version"] == 30
    rows = _rows(run_dir)
    train = [r for r in rows if "rollout/staleness" in r]
    assert train[0]["rollout/staleness"] == 0 and max(r["rollout/staleness"] for r in train) == 1
    assert sum(r["rollout/staleness"] for r in train[1:]) >= 0.8 * (len(train) - 1)   # one step off, nearly always
    before = next(r["eval/pass@1"] for r in rows if r["step"] == 0)
    after = next(r["eval/pass@1"] for r in rows if r["step"] == 30)
    assert after >= before + 0.15, (before, after)
