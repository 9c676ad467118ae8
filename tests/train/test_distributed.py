"""Data-parallel training (DDP, FSDP2) on 2 CPU processes with gloo, launched by torchrun.

Every multi-process run is marked `slow` and `distributed` (in `make test`; `make test-dist` runs them
alone, about 3 minutes on 2 cores): 2 processes on a global batch give the loss and
gradient of one process on it (DDP and FSDP2, token- and sequence-level aggregation); the DDP and
FSDP2 workers pass the reusable worker checks; ranks with different configs are refused; a rank
whose groups are all filtered does not hang the job; the curriculum is shared over ranks; rewriting at 2 processes matches 1; resume at 2
and at 1 process; a rank killed
with SIGKILL; LoRA under FSDP2; 2 processes teach the demo task (after the demo's one-minute warm
start). The unit checks of the collective helpers' arithmetic, and `grpokit export`, need no
process group.
"""

from __future__ import annotations

import json
import shutil
import time

import psutil
import pytest
import torch

from grpokit.config import load_config
from grpokit.errors import ConfigError
from grpokit.models.lora import four_bit_unavailable
from grpokit.train import checkpoint as ckpt_lib
from grpokit.train import distributed
from grpokit.train.build import reference_for
from grpokit.train.collect import KeepRate
from grpokit.train.worker import LocalWorker
from tests.fixtures import small_overrides, tiny_run_inputs
from tests.train import torchrun
from tests.train.dist_programs import COMBINATIONS, equivalence_config, fixed_batch, tiny_policy, train_one_step

HAS_4BIT = four_bit_unavailable("cpu") is None


# ---------------------------------------------------------------------- unit: no process group
def test_auto_is_fsdp2_beyond_one_process_and_none_alone():
    assert distributed.resolve_mode("auto", 1) == "none"
    assert distributed.resolve_mode("auto", 4) == "fsdp2"
    assert distributed.resolve_mode("ddp", 2) == "ddp"
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        distributed.resolve_mode("none", 2)


def test_auto_takes_ddp_for_lora_that_fsdp2_cannot_shard():
    def lora(*over):
        return load_config(None, ["lora.enabled=true", *over]).lora
    assert distributed.resolve_mode("auto", 2, lora("lora.load_in_4bit=true")) == "ddp"
    assert distributed.resolve_mode("auto", 2, lora()) == "ddp"                         # adapter_off reference
    assert distributed.resolve_mode("auto", 2, lora("lora.reference=copy")) == "fsdp2"
    assert distributed.resolve_mode("auto", 1, lora("lora.load_in_4bit=true")) == "none"
    distributed.check_config(load_config(None, ["lora.enabled=true", "lora.load_in_4bit=true"]), 2)   # auto: accepted
    for over, why in ((["lora.load_in_4bit=true"], "4-bit base"), ([], "adapter_off")):
        cfg = load_config(None, ["lora.enabled=true", "train.distributed=fsdp2", *over])
        with pytest.raises(ConfigError, match=f"cannot shard a LoRA run with .*{why}.*use train.distributed=ddp"):
            distributed.check_config(cfg, 2)
        distributed.check_config(load_config(None, ["lora.enabled=true", "train.distributed=ddp", *over]), 2)


def test_an_engine_copy_of_a_sharded_policy_is_refused_with_the_way_out():
    with pytest.raises(ConfigError, match="hf_copy does not run under train.distributed=fsdp2.*rollout.engine=hf"):
        distributed.check_config(load_config(None, ["rollout.engine=hf_copy"]), 2)          # auto: fsdp2
    distributed.check_config(load_config(None, ["rollout.engine=hf_copy", "train.distributed=ddp"]), 2)


def test_single_process_never_joins_a_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init(load_config(None, [])) is None
    assert not torch.distributed.is_initialized()


def test_groups_must_divide_over_the_ranks():
    cfg = load_config(None, ["rollout.group_size=4", "rollout.batch_size=12"])     # 3 prompts per step
    with pytest.raises(ConfigError, match="not divisible by the world size 2"):
        distributed.check_config(cfg, 2)
    distributed.check_config(cfg, 3)


class _Ranks(distributed.DistContext):
    """A context whose all-gather returns given per-rank values (the quota arithmetic alone)."""

    def __init__(self, rank, counts):
        super().__init__(mode="ddp", rank=rank, world=len(counts), local_rank=rank, device=torch.device("cpu"))
        self.counts = counts

    def gather(self, obj):
        return list(self.counts)


def test_dynamic_sampling_quota_is_filled_in_rank_order():
    # 5 groups still wanted; the ranks found 3, 0 and 4: rank 0 keeps 3, rank 1 none, rank 2 the other 2
    assert [_Ranks(r, [3, 0, 4]).keep_groups([3, 0, 4][r], 5) for r in range(3)] == [(3, 5, 7), (0, 5, 7), (2, 5, 7)]
    assert [_Ranks(r, [1, 0]).keep_groups([1, 0][r], 4) for r in range(2)] == [(1, 1, 1), (0, 1, 1)]


def test_metric_reductions():
    assert distributed.reduction("loss/policy") == "sum"
    assert distributed.reduction("policy/ratio_max") == "max"
    assert distributed.reduction("time/rollout") == "max"
    assert distributed.reduction("policy/logprob_min") == "min"
    assert distributed.reduction("reward/mean") == "mean"


def test_step_seeds_differ_by_rank_and_step_and_repeat():
    a, b = _Ranks(0, [0, 0]), _Ranks(1, [0, 0])
    assert a.step_seed(0, 3) == _Ranks(0, [0, 0]).step_seed(0, 3)
    assert len({a.step_seed(0, 3), b.step_seed(0, 3), a.step_seed(0, 4), a.step_seed(1, 3)}) == 4


def test_group_seeds_do_not_depend_on_the_world_size():
    """A group's sampling seed comes from (seed, step, its position in the global draw): the ranks
    of a 2- or 4-process job hold, between them, the single process's seeds, in the same places."""
    one = _Ranks(0, [0]).group_seeds(7, 3, first=8, prompts=8)
    assert len(set(one)) == 8
    for world in (2, 4):
        ranks = [_Ranks(r, [0] * world).group_seeds(7, 3, first=8, prompts=8) for r in range(world)]
        interleaved = [ranks[q % world][q // world] for q in range(8)]     # rank r holds q = r, r + world, ...
        assert interleaved == one
    assert _Ranks(0, [0]).group_seeds(7, 4, first=8, prompts=8) != one                 # another step
    assert _Ranks(0, [0]).group_seeds(7, 3, first=0, prompts=8) != one                 # another round


def test_optimizer_state_moves_between_numbered_and_named():
    model, _ = tiny_policy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[4, 5, 6]])).logits.sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    named = ckpt_lib.optimizer_state_by_name(opt.state_dict(), names)
    assert set(named["state"]) == set(names)
    back = ckpt_lib.optimizer_state_by_index(named, names)
    for i, st in opt.state_dict()["state"].items():
        assert torch.equal(back["state"][i]["exp_avg"], st["exp_avg"])
    with pytest.raises(RuntimeError, match="does not train"):
        ckpt_lib.optimizer_state_by_index(named, names[1:])


# ---------------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence")
    torchrun.run(2, torchrun.program("equivalence", out), timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode,agg", COMBINATIONS)
def test_two_processes_give_the_one_process_gradient(equivalence_runs, mode, agg):
    """Each rank trains on its whole groups of a 4-group batch; the single process on all of it.
    float64: loss, applied gradient and updated weights agree to rounding."""
    cfg = equivalence_config(agg, "none")
    model, tok = tiny_policy()
    worker = LocalWorker(cfg, model, tok, reference_for(cfg, model))
    m, grads = train_one_step(worker, fixed_batch(tok))
    weights = dict(worker.export_weights())
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3       # a real gradient to compare
    for rank in (0, 1):
        got = torch.load(equivalence_runs / f"rank{rank}_{mode}_{agg}.pt", weights_only=False)
        for key in ("loss/policy", "loss/total"):
            assert got["metrics"][key] == pytest.approx(m[key], rel=0, abs=1e-12), key
        assert got["grads"].keys() == grads.keys()
        for n in grads:
            torch.testing.assert_close(got["grads"][n], grads[n], rtol=0, atol=1e-12, msg=n)
        for n in weights:
            torch.testing.assert_close(got["weights"][n], weights[n], rtol=0, atol=1e-12, msg=n)


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_workers_pass_the_worker_checks(tmp_path):
    torchrun.run(2, torchrun.program("conformance", tmp_path), timeout=300)
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == [
        "rank0_ddp.ok", "rank0_fsdp2.ok", "rank1_ddp.ok", "rank1_fsdp2.ok"]


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_with_different_configs_are_refused(tmp_path):
    torchrun.run(2, torchrun.program("mismatch", tmp_path), timeout=120)
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.err")}
    assert sorted(errors) == ["rank0.err", "rank1.err"]
    assert all("different configs (ranks [1] differ from rank 0)" in e for e in errors.values())


# ---------------------------------------------------------------------- end-to-end (make test-dist)
@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("dist_inputs"))


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train_args(inputs, run_dir, **extra) -> list[str]:
    _, model_dir, train, _ = inputs
    return ["-m", "grpokit", "train", *small_overrides(model_dir, train, run_dir, **{
        "train.dist_timeout_s": 60, "train.check_rewards": "false", "train.batch_advice": "false", **extra})]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_whose_groups_are_all_filtered_does_not_hang(tmp_path, inputs):
    """Dynamic sampling, FSDP2: rank 1's groups all score alike every round; the job still finishes
    (every rank generates in every round: a sharded policy gathers its weights for it), and
    the global quota of kept groups comes from rank 0. The rounds are sized by the keep rate counted
    over both ranks (the widths recomputed here), some of them odd: rank 0 then holds a group more."""
    _, model_dir, train, _ = inputs
    run_dir = tmp_path / "run"
    argv = ["train", *small_overrides(model_dir, train, run_dir, **{
        "rollout.dynamic_sampling": "true", "rollout.max_sampling_rounds": 3, "rewards": "[{name: rank0_varied}]",
        "train.steps": 2, "train.dist_timeout_s": 60, "train.check_rewards": "false",
        "train.batch_advice": "false", "train.distributed": "fsdp2"})]
    torchrun.run(2, torchrun.program("train_filtered", tmp_path, *argv), timeout=150)
    assert [(tmp_path / f"rank{r}.exit").read_text() for r in (0, 1)] == ["0", "0"]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    rate, want, widths = KeepRate(), [], []
    for _ in rows:    # 4 prompts per step, at most 12; rank 0 holds ceil(n / 2) of a round of n, all kept
        rate.new_step()
        missing, drawn, rounds = 4, 0, 0
        while missing > 0 and drawn <= 10:                 # a round is at least as wide as the job
            n = max(2, rate.width(missing, 12 - drawn, 0.9))
            rate.add((n + 1) // 2, n)
            missing, drawn, rounds = missing - min(missing, (n + 1) // 2), drawn + n, rounds + 1
            widths.append(n)
        want.append((4, rounds, drawn))
    assert any(n % 2 for n in widths)
    assert [(r["dynamic/kept_groups"], r["dynamic/rounds"], r["dynamic/sampled_groups"]) for r in rows] == want
    # rank 1 keeps none of the job's groups and trains on none: the batch is rank 0's kept groups alone
    # (rewards 0, 1, 0, 1 within each), not padded with rank 1's all-alike ones (rewards 0)
    assert all(r["reward/mean"] == 0.5 and r["optim/grad_norm"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_curriculum_is_shared_over_ranks(tmp_path, inputs):
    """data.curriculum at 2 processes: every rank observes every rank's groups, so both hold the same
    statistics and draw the same global prompt list, the one one process draws: per step, the same
    bar, running pass rate and rewards as the 1-process run (each group samples from its own seeded
    stream at any world size)."""
    _, model_dir, train, _ = inputs
    rows = {}
    for world in (2, 1):
        run_dir, out = tmp_path / f"run{world}", tmp_path / f"out{world}"
        argv = ["train", *small_overrides(model_dir, train, run_dir, **{
            "rewards": "[{name: digit_parity}]", "train.steps": 4, "data.curriculum.enabled": "true",
            "data.curriculum.start": 0.2, "data.curriculum.rise_from": 0.3, "data.curriculum.rise_to": 0.6,
            "data.curriculum.running_ema": 0.5, "train.dist_timeout_s": 60, "train.check_rewards": "false",
            "train.batch_advice": "false", "train.distributed": "ddp"})]
        torchrun.run(world, torchrun.program("train_parity", out, *argv), timeout=150)
        assert [(out / f"rank{r}.exit").read_text() for r in range(world)] == ["0"] * world
        rows[world] = _rows(run_dir)
    assert [r["step"] for r in rows[2]] == [1, 2, 3, 4]
    for a, b in zip(rows[2], rows[1]):
        for k in ("curriculum/bar", "curriculum/pass_rate", "reward/mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-9), (a["step"], k)
    assert rows[2][-1]["curriculum/bar"] > 0.2          # the pass rate lifted it


@pytest.mark.slow
@pytest.mark.distributed
def test_an_engine_copy_under_ddp_trains_as_the_policy_engine(tmp_path, inputs):
    """`rollout.engine: hf_copy` at 2 DDP ranks: each rank's copy is pushed its replica's weights
    after every step, so each step samples what the policy itself (`hf`) samples: the same rewards
    and lengths, and loss and gradient norm up to rounding (the copy's pi_old is recomputed by the
    trainer, the policy engine's is its sampler's), step by step."""
    rows = {}
    for engine in ("hf_copy", "hf"):
        run_dir, out = tmp_path / engine, tmp_path / f"{engine}_out"
        argv = _train_args(inputs, run_dir, **{"train.steps": 3, "rollout.engine": engine, "train.distributed": "ddp",
                                                "rewards": "[{name: digit_parity}]", "optim.lr": 5e-2})[2:]
        torchrun.run(2, torchrun.program("train_parity", out, *argv), timeout=150)
        assert [(out / f"rank{r}.exit").read_text() for r in (0, 1)] == ["0", "0"]
        rows[engine] = _rows(run_dir)
    assert [r["step"] for r in rows["hf_copy"]] == [1, 2, 3]
    for a, b in zip(rows["hf_copy"], rows["hf"]):
        assert a["reward/mean"] == b["reward/mean"] and a["completion/length_mean"] == b["completion/length_mean"]
        for k in ("loss/total", "optim/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)   # pi_old: recomputed vs sampled


@pytest.mark.slow
@pytest.mark.distributed
def test_rewriting_at_two_processes_matches_one(tmp_path, inputs):
    """Wrong-answer rewriting at 2 processes, DDP and FSDP2: the notes' NLL is normalised by their
    tokens over both ranks and both ranks' note gradients reach the update, so step 2 (trained on
    step 1's update, rewriting term included) matches the 1-process run."""
    rows = {}
    for name, world, mode in (("ddp", 2, "ddp"), ("fsdp2", 2, "fsdp2"), ("one", 1, "ddp")):
        run_dir = tmp_path / name
        torchrun.run(world, _train_args(inputs, run_dir, **{
            "train.steps": 2, "algorithm.rewrite.enabled": "true", "algorithm.rewrite.weight": 0.5,
            "algorithm.rewrite.max_per_step": 64, "train.distributed": mode}), timeout=150)
        rows[name] = _rows(run_dir)
    for mode in ("ddp", "fsdp2"):
        assert [r["step"] for r in rows[mode]] == [1, 2]
        for a, b in zip(rows[mode], rows["one"]):
            assert a["loss/rewrite"] > 0 and a["rewrite/sequences"] == b["rewrite/sequences"]
            for k in ("loss/rewrite", "loss/total", "reward/mean", "optim/grad_norm"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (mode, a["step"], k)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not HAS_4BIT, reason="bitsandbytes 4-bit is not available on this platform")
def test_qlora_at_two_processes_matches_one(tmp_path, inputs):
    """QLoRA under data parallelism (`auto` picks DDP for a 4-bit base): the same 4-bit base on each
    rank, only the adapters' gradients reduced, the exact adapter-off reference; step 2 (trained on
    step 1's update) matches the 1-process run, and the checkpoint holds the adapters alone. (The
    argv after "train": _train_args without "-m grpokit".)"""
    rows, logs = {}, {}
    for world in (2, 1):
        run_dir, out = tmp_path / f"q{world}", tmp_path / f"out{world}"
        argv = _train_args(inputs, run_dir, **{
            "train.steps": 2, "lora.enabled": "true", "lora.rank": 4, "lora.load_in_4bit": "true",
            "optim.lr": 5e-2, "algorithm.kl.beta": 0.05, "train.save_every": 2,
            "rewards": "[{name: digit_parity}]",                          # auto at 2 processes; DDP at 1
            **({} if world == 2 else {"train.distributed": "ddp"})})[2:]   # draws each group from the same stream
        _, logs[world], _ = torchrun.run(world, torchrun.program("train_parity", out, *argv), timeout=200)
        assert [(out / f"rank{r}.exit").read_text() for r in range(world)] == ["0"] * world
        rows[world] = _rows(run_dir)
    assert "train.distributed=auto: DDP, as FSDP2 cannot shard a LoRA run with a 4-bit base" in logs[2]
    assert [r["step"] for r in rows[2]] == [1, 2]
    for a, b in zip(rows[2], rows[1]):
        for k in ("loss/total", "reward/mean", "optim/grad_norm", "kl/ref"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    assert rows[2][1]["kl/ref"] > 0                     # the adapters moved the policy off its base
    saved = tmp_path / "q2" / "checkpoints" / "step_000002"
    assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()


_NOT_REPRODUCED = ("time/", "throughput/", "memory/", "ref/cache")   # the cache is the process's, not the run's


def _same_metrics(a: dict, b: dict, rel: float = 1e-6, abs_: float = 1e-9) -> None:
    keys = [k for k in a if not k.startswith(_NOT_REPRODUCED) and k not in ("time", "step")]
    assert keys and set(keys) <= set(b)
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=rel, abs=abs_, nan_ok=True), k


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_at_two_and_at_one_process(tmp_path, inputs):
    """A 2-process FSDP2 run saves a sharded (DCP) checkpoint every step; resumed from step 2 at 2
    processes and at 1, step 3 repeats the uninterrupted run's metrics: the same weights, optimizer
    state and data position, and each group sampled from its own seeded stream whatever the world
    size (float32: the one-process sums differ from the two-process ones by rounding)."""
    full = tmp_path / "full"
    torchrun.run(2, _train_args(inputs, full, **{"train.steps": 3, "train.save_every": 1, "train.keep_last": 5,
                                                 "train.distributed": "fsdp2"}), timeout=150)
    expected = _rows(full)[-1]
    assert expected["step"] == 3
    ck = full / "checkpoints" / "step_000002"
    assert len(list((ck / "dcp").glob("*.distcp"))) == 2 and not list(ck.glob("*.safetensors"))
    for world in (2, 1):
        run_dir = tmp_path / f"resumed{world}"
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(ck, run_dir / "checkpoints" / "step_000002")
        torchrun.run(world, _train_args(inputs, run_dir, **{"train.steps": 3, "train.distributed": "fsdp2"})
                     + ["--resume"], timeout=150)
        got = _rows(run_dir)
        assert [r["step"] for r in got] == [3]
        if world == 2:
            _same_metrics(expected, got[0])
        else:
            _same_metrics(expected, got[0], rel=1e-4, abs_=1e-6)
            assert got[0]["reward/mean"] == expected["reward/mean"]          # the same completions
            assert got[0]["completion/length_mean"] == expected["completion/length_mean"]


def _ranks_of(proc) -> list[psutil.Process]:
    return [c for c in psutil.Process(proc.pid).children(recursive=True) if "grpokit" in " ".join(c.cmdline())]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_stops_the_job_and_resume_continues(tmp_path, inputs):
    run_dir = tmp_path / "run"
    proc = torchrun.start(2, _train_args(inputs, run_dir, **{"train.steps": 400, "train.save_every": 1,
                                                             "train.distributed": "fsdp2"}))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ckpt_lib.latest_checkpoint(run_dir) in (
                None, ckpt_lib.checkpoint_path(run_dir, 0)):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            time.sleep(0.5)
        ranks = _ranks_of(proc)
        assert len(ranks) == 2, ranks
        victim = max(ranks, key=lambda p: p.pid)
        victim.kill()
        t0 = time.monotonic()
        code = proc.wait(timeout=60)                   # the others stop in bounded time
        stopped_after = time.monotonic() - t0
        out = proc.stdout.read()
    finally:
        torchrun.kill_group(proc)
    assert code != 0 and stopped_after < 60
    assert "SIGKILL" in out or "Signal 9" in out, out[-3000:]
    last = ckpt_lib.latest_checkpoint(run_dir)
    step = int(last.name.split("_")[1])
    torchrun.run(2, _train_args(inputs, run_dir, **{"train.steps": step + 1, "train.distributed": "fsdp2"})
                 + ["--resume"], timeout=150)
    assert _rows(run_dir)[-1]["step"] == step + 1


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_under_fsdp2_trains_only_adapters_and_exports_the_merge(tmp_path):
    """Two steps of LoRA on an FSDP2-sharded policy: only adapter weights move; the merged model
    rank 0 writes gives the logits of the same adapters merged by PEFT in one unsharded process."""
    from transformers import AutoModelForCausalLM

    from grpokit.models.lora import load_adapter_weights, wrap_lora
    from tests.train.dist_programs import lora_config

    torchrun.run(2, torchrun.program("lora", tmp_path), timeout=300)
    changed = json.loads((tmp_path / "changed.json").read_text())
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)
    assert any(".lora_B." in n for n in changed)               # B starts at 0: the update is real
    model, _ = tiny_policy()
    peft_model = wrap_lora(model.float(), lora_config().lora)
    load_adapter_weights(peft_model, tmp_path / "merged")
    reference = peft_model.merge_and_unload().eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 4]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(tiny_policy()[0].float()(ids).logits, reference(ids).logits, atol=1e-4)
    streamed = torch.load(tmp_path / "exported.pt")                # export_weights: the same merge
    for n, t in exported.state_dict().items():
        if n in streamed:
            torch.testing.assert_close(streamed[n].float(), t, rtol=0, atol=1e-6, msg=n)


def test_export_writes_a_plain_model_and_refuses_an_incomplete_checkpoint(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from grpokit.cli import main

    model, tok = tiny_policy()
    model = model.float()
    ck = ckpt_lib.save_checkpoint(tmp_path / "run", 3, model, tok, {"step": 3})
    assert main(["export", str(ck), str(tmp_path / "out")]) == 0
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for n, t in model.state_dict().items():
        assert torch.equal(out.state_dict()[n], t), n
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert main(["export", str(ck), str(tmp_path / "out")]) == 2              # not over a non-empty folder
    (ck / ckpt_lib.MARKER).unlink()
    assert main(["export", str(ck), str(tmp_path / "again")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------- the launcher's failure line
ABORT_BANNER = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=====================================================
tests/train/dist_programs.py FAILED
-----------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 3358)  (SIGABRT)
-----------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 3357)  (SIGABRT)
  traceback : Signal 6 (SIGABRT) received by PID 3357
=====================================================
"""


def test_the_failure_line_names_the_root_cause_rank_and_why(tmp_path):
    from grpokit.train.launch import failure_line

    assert failure_line(ABORT_BANNER, tmp_path, 2, 1) == "error: rank 0 of 2 failed (killed by SIGABRT)"
    (tmp_path / "rank1.err").write_text("data.path: no such file\n")
    exit2 = ABORT_BANNER.replace("rank      : 0 (local_rank: 0)", "rank      : 1 (local_rank: 1)").replace(
        "exitcode  : -6 (pid: 3357)  (SIGABRT)", "exitcode  : 2 (pid: 3357)")
    assert failure_line(exit2, tmp_path, 2, 1) == "error: rank 1 of 2 failed (exit code 2): data.path: no such file"
    assert "before any rank reported" in failure_line("rendezvous timed out", tmp_path, 2, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failed_launch_ends_with_one_line_naming_the_rank(tmp_path, inputs):
    """`grpokit train --nproc 2` whose ranks stop on a user error: the last line names the rank,
    its exit code and its own message."""
    import subprocess
    import sys

    _, model_dir, train, _ = inputs
    argv = ["train", "--nproc", "2", *small_overrides(model_dir, tmp_path / "missing.jsonl", tmp_path / "run", **{
        "train.dist_timeout_s": 60})]
    proc = subprocess.Popen([sys.executable, "-m", "grpokit", *argv], cwd=torchrun.REPO, env=torchrun.job_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("the failed job did not end in 180 s")
    finally:
        torchrun.kill_group(proc)                      # nothing left behind, whatever happened
    last = err.strip().splitlines()[-1]
    assert proc.returncode != 0
    assert last.startswith("error: rank ") and " of 2 failed (exit code 2): " in last and "missing.jsonl" in last, last


# ---------------------------------------------------------------------- the Comm, one and two processes
def test_the_single_process_comm_conforms():
    from grpokit.train.comm import LocalComm
    from tests.train.comm_conformance import check_comm

    check_comm(LocalComm())


def test_the_conformance_checks_catch_a_comm_that_drops_a_rank():
    """The shared checks can fail: a two-rank comm whose gather loses rank 1's value."""
    from tests.train.comm_conformance import check_comm

    with pytest.raises(AssertionError):
        check_comm(_LossyRanks())


class _LossyRanks(distributed.DistContext):
    def __init__(self):
        super().__init__(mode="ddp", rank=0, world=2, local_rank=0, device=torch.device("cpu"))

    def gather(self, obj):
        return [obj, obj]                  # rank 1's value lost: rank 0's twice


@pytest.mark.slow
@pytest.mark.distributed
def test_the_gloo_comm_conforms(tmp_path):
    torchrun.run(2, torchrun.program("comm", tmp_path), timeout=120)
    assert sorted(p.name for p in tmp_path.glob("*.ok")) == ["rank0.ok", "rank1.ok"]
