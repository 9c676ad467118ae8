"""Checks any TrainingWorker must pass, reusable by every implementation (local, DDP, FSDP2).

`check_worker(make_worker, make_batch)`: `make_worker()` builds a fresh worker over the same initial
weights each call, with a frozen-copy reference; `make_batch(worker)` returns a Batch (rows with
completions, rewards) for it. Each check can fail on a worker that breaks the contract.
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path

import torch

from grpokit.train.worker import TrainingWorker


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter as one whole tensor (an FSDP2 worker's are DTensor shards)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _weights(worker) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().float() for n, t in worker.export_weights()}


def _with_advantages(batch):
    batch.advantages = torch.tensor([(-1.0) ** i * (1 + i % 3) for i in range(len(batch))])
    return batch


def check_logprobs(worker, batch) -> None:
    pol = worker.logprobs(batch, "policy")
    ref = worker.logprobs(batch, "reference")
    assert tuple(pol.shape) == tuple(batch.mask.shape) == tuple(ref.shape)
    valid = batch.mask.bool()
    assert torch.isfinite(pol).all() and (pol[valid] <= 0).all() and (pol[~valid] == 0).all()
    torch.testing.assert_close(pol, ref, atol=1e-5, rtol=0)      # untrained: the reference is the policy


def check_train_step(worker, batch) -> dict:
    before = _weights(worker)
    ref_before = worker.logprobs(batch, "reference")
    batch.ref_logp = ref_before
    m = worker.train_step(_with_advantages(batch), 0.05)
    for key in ("loss/policy", "loss/total", "optim/grad_norm", "optim/lr", "policy/entropy",
                "guard/updates_skipped", "guard/causes"):
        assert key in m, key
    assert m["guard/updates_skipped"] == 0 and m["guard/causes"] == []
    assert math.isfinite(m["loss/total"]) and m["optim/grad_norm"] > 0
    after = _weights(worker)
    assert any(not torch.equal(before[n], after[n]) for n in before), "train_step changed no weight"
    assert torch.equal(worker.logprobs(batch, "reference"), ref_before), "the reference moved"
    return m


def check_state_round_trip(make_worker, make_batch, folder=None, barrier=None) -> None:
    """A worker restored through the checkpoint protocol (`save_weights` + `state_dict`, then
    `load_weights` + `load_state_dict` on a fresh one) continues identically. `folder`: where the
    weights go (the same on every rank of a job); `barrier`: waits for every rank's writing."""
    folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="worker_ckpt_"))
    a = make_worker()
    batch = make_batch(a)
    a.train_step(_with_advantages(batch), 0.0)
    a.save_weights(folder)
    state = copy.deepcopy(a.state_dict())             # as through a checkpoint: no tensor shared
    if barrier is not None:
        barrier()
    b = make_worker()
    b.load_weights(folder)
    b.load_state_dict(state)
    src = {n: t.float() for n, t in a.export_weights()}
    got = {n: t.float() for n, t in b.export_weights()}
    assert got.keys() == src.keys()
    for n in src:
        assert torch.equal(got[n], src[n]), n
    a.train_step(_with_advantages(make_batch(a)), 0.0)
    b.train_step(_with_advantages(make_batch(b)), 0.0)
    wa, wb = _weights(a), _weights(b)
    for n in wa:
        torch.testing.assert_close(wa[n], wb[n], atol=1e-6, rtol=0)


def check_export_weights(worker) -> None:
    """Full, Hugging Face-named tensors that load into a plain model of the same architecture, and
    exporting leaves the trained weights untouched."""
    from transformers import AutoModelForCausalLM

    trained = {n: _full(p.detach()).clone() for n, p in worker.model.named_parameters()}
    named = dict(worker.export_weights())
    base = worker.model.get_base_model() if hasattr(worker.model, "get_base_model") else worker.model
    plain = AutoModelForCausalLM.from_config(base.config)
    missing, unexpected = plain.load_state_dict({n: t.to(torch.float32) for n, t in named.items()}, strict=False)
    assert not unexpected, unexpected[:3]
    tied = {"lm_head.weight"} if getattr(base.config, "tie_word_embeddings", False) else set()
    assert set(missing) <= tied, missing[:3]
    for n, p in worker.model.named_parameters():
        assert torch.equal(_full(p.detach()), trained[n]), f"export_weights changed {n}"


def check_nonfinite_guard(make_worker, make_batch) -> None:
    """A step whose forward pass is not finite reaches no weight and names its cause."""
    w = make_worker()
    batch = _with_advantages(make_batch(w))
    with torch.no_grad():
        emb = w.model.get_input_embeddings().weight
        poisoned = _full(emb).clone()
        poisoned[batch.completion_ids[0, 0]] = float("nan")
        if hasattr(emb, "full_tensor"):               # back into this rank's shard
            from torch.distributed.tensor import distribute_tensor
            poisoned = distribute_tensor(poisoned, emb.device_mesh, emb.placements)
        emb.copy_(poisoned)
    before = _weights(w)
    m = w.train_step(batch, 0.0)
    assert m["guard/updates_skipped"] >= 1 and m["guard/causes"]
    after = _weights(w)
    for n in before:
        assert torch.equal(torch.nan_to_num(before[n], nan=7.0), torch.nan_to_num(after[n], nan=7.0)), n


def check_worker(make_worker, make_batch, folder=None, barrier=None) -> None:
    w = make_worker()
    assert isinstance(w, TrainingWorker)
    batch = make_batch(w)
    check_logprobs(w, batch)
    check_export_weights(w)
    check_train_step(w, batch)
    check_export_weights(w)
    check_state_round_trip(make_worker, make_batch, folder, barrier)
    check_nonfinite_guard(make_worker, make_batch)
