"""Sharded (DCP) checkpoints read in one process, without a process group: what a single process
does with an FSDP2 run's checkpoint (resume at world size 1, rollback, `grpokit export`). The
same checkpoints written by 2 FSDP2 ranks are tested in tests/train/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from grpokit.train import checkpoint as ckpt_lib
from grpokit.models import load_model, sharded
from grpokit.models.hf import ModelLoadError
from grpokit.train.build import reference_for
from grpokit.train.worker import LocalWorker
from tests.train.dist_programs import equivalence_config, fixed_batch, tiny_policy, train_one_step


def _worker(seed: int = 0):
    cfg = equivalence_config("token_mean", "none")
    model, tok = tiny_policy(seed)
    return LocalWorker(cfg, model, tok, reference_for(cfg, model)), tok


def _sharded_checkpoint(tmp_path, worker, tok):
    """A complete checkpoint whose weights and optimizer state are a DCP folder."""
    tmp = ckpt_lib.temp_checkpoint(tmp_path / "run", 1)
    sharded.save(tmp, worker.model, worker.optimizer)
    worker.model.config.save_pretrained(tmp)
    state = {"step": 1, "optimizer": sharded.IN_DCP, "scheduler": worker.scheduler.state_dict()}
    return ckpt_lib.save_checkpoint(tmp_path / "run", 1, worker.model, tok, state, tmp=tmp)


def test_a_sharded_checkpoint_restores_weights_and_optimizer_state(tmp_path):
    trained, tok = _worker()
    train_one_step(trained, fixed_batch(tok))                 # AdamW moments exist and are not zero
    ck = _sharded_checkpoint(tmp_path, trained, tok)
    assert sharded.is_sharded(ck) and not list(ck.glob("*.safetensors"))

    fresh, _ = _worker()                    # the same start (and reference), no optimizer state,
    with torch.no_grad():                   # and weights moved away from the checkpoint's
        for p in fresh.model.parameters():
            p.add_(0.01)
    fresh.load_weights(ck)
    fresh.load_state_dict(ckpt_lib.load_state(ck))
    for (n, p), (_, q) in zip(trained.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(p, q), n
    a, b = trained.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for i in a["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(a["state"][i][k]), torch.as_tensor(b["state"][i][k])), (i, k)
    # the next step is the same step
    m1, _ = train_one_step(trained, fixed_batch(tok, seed=1))
    m2, _ = train_one_step(fresh, fixed_batch(tok, seed=1))
    assert m1["loss/total"] == m2["loss/total"] and m1["optim/grad_norm"] == m2["optim/grad_norm"]


def test_export_writes_a_plain_model_from_a_sharded_checkpoint(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from grpokit.cli import main

    worker, tok = _worker()
    train_one_step(worker, fixed_batch(tok))
    ck = _sharded_checkpoint(tmp_path, worker, tok)
    with pytest.raises(ModelLoadError, match="grpokit export"):          # not loadable as it is
        load_model(ck)
    assert main(["export", str(ck), str(tmp_path / "out")]) == 0
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 4]])
    with torch.no_grad():
        torch.testing.assert_close(out(ids).logits, worker.model.eval()(ids).logits, rtol=0, atol=1e-12)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_an_incomplete_dcp_folder_is_not_a_checkpoint_to_load(tmp_path):
    worker, _ = _worker()
    (tmp_path / "ck" / sharded.DCP_DIR).mkdir(parents=True)                # no .metadata: cut short
    assert not sharded.is_sharded(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint"):
        sharded.load(tmp_path / "ck", worker.model)
