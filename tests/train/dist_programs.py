"""Programs the distributed tests run under torchrun (one process per rank): each writes what it
measured to OUT/rank<R>.pt for the test to compare with a single-process run.

  python -m torch.distributed.run --nproc-per-node 2 tests/train/dist_programs.py equivalence OUT MODE AGG
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpokit.config import load_config
from grpokit.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpokit.train import distributed
from grpokit.train.batch import Batch
from grpokit.train.build import reference_for


def equivalence_config(agg: str, mode: str):
    return load_config(None, [
        "rollout.group_size=4", "rollout.batch_size=16", "rollout.max_new_tokens=6", "rollout.temperature=1.0",
        f"algorithm.loss_agg={agg}", "algorithm.kl.beta=0.05", "algorithm.kl.controller=fixed",
        "optim.micro_batch_size=3", "optim.lr=1e-3", "optim.max_grad_norm=1e9",
        f"train.distributed={mode}", "train.dist_timeout_s=60", "monitor.sinks=[jsonl]"])


def tiny_policy(seed: int = 0):
    tok = build_char_tokenizer("0123456789+= ")
    model = build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, max_positions=64, seed=seed)
    return model.double().eval(), tok


def fixed_batch(tok, n_groups: int = 4, G: int = 4, seed: int = 0) -> Batch:
    """A batch of `n_groups` groups of G completions of different lengths, with rewards and
    group-relative advantages: the same on every rank and in the single-process run."""
    g = torch.Generator().manual_seed(seed)
    B, T = n_groups * G, 6
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ids = torch.randint(4, len(tok), (B, T), generator=g) * mask + tok.pad_token_id * (1 - mask)
    prompts = [torch.randint(4, len(tok), (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_groups)]
    rewards = torch.randint(0, 3, (B,), generator=g).double()
    gid = torch.arange(n_groups).repeat_interleave(G)
    mean = torch.zeros(B, dtype=torch.float64)
    std = torch.zeros(B, dtype=torch.float64)
    for k in range(n_groups):
        r = rewards[gid == k]
        mean[gid == k], std[gid == k] = r.mean(), r.std()
    adv = torch.where(std > 0, (rewards - mean) / (std + 1e-6), 0.0)
    return Batch(uid=[f"0-{int(k)}-{i}" for i, k in enumerate(gid)], prompt_index=gid.clone(), group_id=gid,
                 rows=[{"prompt": "x"} for _ in range(B)], prompt_ids=[prompts[int(k)] for k in gid],
                 completion_ids=ids, mask=mask, sampler_logp=torch.zeros(B, T), finish_reason=["eos"] * B,
                 completions=[""] * B, rewards=rewards, advantages=adv.float())


def record_gradients(worker, grads: list):
    """Keep a full copy of the gradient each optimizer step applies (a step pre-hook: observing it)."""
    names = worker.trainable_names()

    def keep(optimizer, args, kwargs):
        params = [p for grp in optimizer.param_groups for p in grp["params"]]
        full = {}
        for n, p in zip(names, params):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            full[n] = g.detach().clone()
        grads.append(full)
    worker.optimizer.register_step_pre_hook(keep)


def train_one_step(worker, batch, beta: float = 0.05) -> tuple[dict, dict]:
    """Reference log-probs, then one training step; (metrics, the gradient applied). The model's own
    forward everywhere: FSDP2's hooks rule grpokit's lean forward out, so both sides use the same."""
    from grpokit.train import forward as lean_forward

    with lean_forward.disabled():
        batch.ref_logp = worker.logprobs(batch, "reference")
        grads: list = []
        record_gradients(worker, grads)
        m = worker.train_step(batch, beta)
    return m, grads[0]


COMBINATIONS = [(mode, agg) for mode in ("ddp", "fsdp2") for agg in ("token_mean", "seq_mean_token_mean")]


def equivalence(out: Path) -> None:
    """One training step on this rank's whole groups of `fixed_batch`, for DDP and FSDP2 and a token-
    and a sequence-level aggregation: OUT/rank<R>_<mode>_<agg>.pt holds the metrics, the applied
    gradient and the weights after the step."""
    from dataclasses import replace

    from grpokit.train.batch import shard_groups
    from grpokit.train.dist_worker import DataParallelWorker

    ctx = distributed.init(equivalence_config("token_mean", "fsdp2"))
    try:
        for mode, agg in COMBINATIONS:
            cfg = equivalence_config(agg, mode)
            model, tok = tiny_policy()
            worker = DataParallelWorker(cfg, model, tok, reference_for(cfg, model), replace(ctx, mode=mode))
            m, grads = train_one_step(worker, shard_groups(fixed_batch(tok), ctx.rank, ctx.world))
            weights = dict(worker.export_weights())
            torch.save({"metrics": {k: v for k, v in m.items() if k != "guard/causes"}, "grads": grads,
                        "weights": weights}, out / f"rank{ctx.rank}_{mode}_{agg}.pt")
    finally:
        distributed.shutdown()


def conformance(out: Path) -> None:
    """The reusable worker checks (tests/train/worker_conformance.py) on DDP and FSDP2 workers."""
    from dataclasses import replace

    from grpokit.train.batch import shard_groups
    from grpokit.train.dist_worker import DataParallelWorker
    from tests.train.worker_conformance import check_worker

    cfg = equivalence_config("token_mean", "fsdp2")
    ctx = distributed.init(cfg)
    try:
        for mode in ("ddp", "fsdp2"):
            def make_worker():
                model, tok = tiny_policy()
                return DataParallelWorker(cfg, model, tok, reference_for(cfg, model), replace(ctx, mode=mode))

            def make_batch(worker):
                return shard_groups(fixed_batch(worker_tok), ctx.rank, ctx.world)

            worker_tok = tiny_policy()[1]
            import torch.distributed as dist
            check_worker(make_worker, make_batch, folder=out / f"checkpoint_{mode}", barrier=dist.barrier)
            (out / f"rank{ctx.rank}_{mode}.ok").write_text("ok")
    finally:
        distributed.shutdown()


def comm(out: Path) -> None:
    """The Comm conformance checks (tests/train/comm_conformance.py) on a gloo rank."""
    from tests.train.comm_conformance import check_comm

    ctx = distributed.init(equivalence_config("token_mean", "ddp"))
    try:
        check_comm(ctx)
        (out / f"rank{ctx.rank}.ok").write_text("ok")
    finally:
        ctx.close()


def lora_config(mode: str = "fsdp2"):
    return load_config(None, [
        "rollout.group_size=4", "rollout.batch_size=16", "rollout.max_new_tokens=6", "rollout.temperature=1.0",
        "algorithm.kl.beta=0.05", "algorithm.kl.controller=fixed", "optim.micro_batch_size=3", "optim.lr=5e-2",
        "lora.enabled=true", "lora.rank=4", "lora.reference=copy", f"train.distributed={mode}",
        "train.dist_timeout_s=60", "monitor.sinks=[jsonl]"])


def lora(out: Path) -> None:
    """LoRA under FSDP2: two training steps on this rank's groups; OUT/changed.json names the
    parameters that moved, OUT/merged the exported merged model, OUT/merged/adapter the adapters."""
    import json

    from grpokit.train.batch import shard_groups
    from grpokit.train.build import build_policy
    from grpokit.train.dist_worker import DataParallelWorker

    cfg = lora_config()
    ctx = distributed.init(cfg)
    try:
        model, tok = tiny_policy()
        policy, reference = build_policy(cfg, model.float())
        worker = DataParallelWorker(cfg, policy, tok, reference, ctx)
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t    # noqa: E731
        before = {n: full(p.detach()).clone() for n, p in worker.model.named_parameters()}
        for step in range(2):
            batch = shard_groups(fixed_batch(tok, seed=step), ctx.rank, ctx.world)
            batch.ref_logp = worker.logprobs(batch, "reference")
            worker.train_step(batch, 0.05, step=step)
        after = {n: full(p.detach()).clone() for n, p in worker.model.named_parameters()}
        changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
        worker.save_weights(out / "merged" if ctx.is_main else None, merged=True)
        exported = dict(worker.export_weights())
        if ctx.is_main:
            (out / "changed.json").write_text(json.dumps(changed))
            torch.save(exported, out / "exported.pt")
    finally:
        distributed.shutdown()


def mismatch(out: Path) -> None:
    """Each rank starts with its own seed: the job must refuse to start."""
    import os

    from grpokit.errors import ConfigError

    cfg = load_config(None, [f"train.seed={os.environ['RANK']}", "train.distributed=ddp", "train.dist_timeout_s=60"])
    try:
        distributed.init(cfg)
    except ConfigError as exc:
        (out / f"rank{os.environ['RANK']}.err").write_text(str(exc))
    finally:
        distributed.shutdown()


def train_filtered(out: Path, *argv) -> None:
    """`grpokit train ARGV` where every group of rank 1 gets equal rewards (dynamic sampling filters
    all of them) while rank 0's vary."""
    import os

    from grpokit.cli import main
    from grpokit.rewards import register

    @register("rank0_varied")
    def rank0_varied(prompts, completions, **columns):
        if os.environ["RANK"] != "0":
            return [0.0] * len(completions)
        return [float(i % 2) for i in range(len(completions))]

    code = main(list(argv))
    (out / f"rank{os.environ['RANK']}.exit").write_text(str(code))


def train_parity(out: Path, *argv) -> None:
    """`grpokit train ARGV` with the reward `digit_parity` (1 when a completion holds an even number of
    digits): about half of a random model's completions pass, on every rank alike."""
    import os

    from grpokit.cli import main
    from grpokit.rewards import register

    @register("digit_parity")
    def digit_parity(prompts, completions, **columns):
        return [float(sum(ch.isdigit() for ch in c) % 2 == 0) for c in completions]

    code = main(list(argv))
    (out / f"rank{os.environ['RANK']}.exit").write_text(str(code))


def vllm_push(out: Path, *overrides) -> None:
    """A run with each rank's colocated vLLM engine (`rollout.engine=vllm` under torchrun) trained for
    `train.steps`, then greedy completions of fixed prompts from the rank's vLLM engine and from the
    trained policy's exported weights in a plain model: rank R writes both to out/rankR.json."""
    import json
    import os


    from grpokit.config import load_config
    from grpokit.models import load_model
    from grpokit.rollout.base import SamplingParams
    from grpokit.rollout.hf import HFEngine
    from grpokit.train import build_trainer
    from grpokit.train.distributed import model_dir_of
    import tests.fixtures  # noqa: F401 - registers the test_varied reward

    cfg = load_config(None, list(overrides))
    tr = build_trainer(cfg, health=False, report=False)
    tr.on_exit = []                           # the job stays joined for the export below
    tr.train()
    plain = load_model(model_dir_of(tr.worker.model), dtype="float32", device="cpu")
    start = {n: t.clone() for n, t in plain.state_dict().items()}
    weights = dict(tr.worker.export_weights())                   # collective under FSDP2
    plain.load_state_dict(weights, strict=False)
    if getattr(plain.config, "tie_word_embeddings", False):
        plain.tie_weights()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 3, 5]]
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    got = tr.engine.generate(prompts, greedy).completion_ids.tolist()
    want = HFEngine(plain, tr.tokenizer).generate(prompts, greedy).completion_ids.tolist()
    rank = os.environ["RANK"]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "vllm": got, "trained": want, "version": tr.engine.weights_version,
        "adapters": getattr(tr.engine, "lora_request", None) is not None,
        "moved": max(float((t - start[n]).abs().max()) for n, t in weights.items())}))
    tr.engine.close()


if __name__ == "__main__":
    what, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    programs = {"equivalence": equivalence, "conformance": conformance, "mismatch": mismatch,
                "train_filtered": train_filtered, "train_parity": train_parity, "lora": lora, "comm": comm,
                "vllm_push": vllm_push}
    code = 0
    try:
        programs[what](out, *sys.argv[3:])
    except BaseException:                    # as Python would print it; the job fails on it
        import traceback
        traceback.print_exc()
        code = 1
    distributed.exit_process(code)           # a rank ends without racing gloo's threads
