"""`rollout.engine: vllm` under torchrun: each rank's colocated vLLM engine (vLLM's
`external_launcher`, the ranks as its data-parallel ranks) generates that rank's groups and is
pushed the trained weights after every step, from a DDP or FSDP2 worker (docs/distributed.md,
"What runs with what"). Two processes, bounded in time, nothing left behind
(tests/train/torchrun.py)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make test-vllm installs it)")

from tests.fixtures import arithmetic_files, small_overrides  # noqa: E402
from tests.rollout.vllm.test_vllm_engine import VLLM_OPTS, tiny_dir  # noqa: E402
from tests.train import torchrun  # noqa: E402

pytestmark = [pytest.mark.distributed]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "ddp+lora"])
def test_two_ranks_with_colocated_vllm_generate_what_the_trained_model_does(tmp_path, mode):
    """DDP, FSDP2, and LoRA under DDP (each rank's vLLM holds the base, pushed once, and takes the
    adapters alone through vLLM's LoRA after every step)."""
    train, _ = arithmetic_files(tmp_path / "data", n_train=64)
    lora = {"lora.enabled": "true", "lora.rank": 4} if mode.endswith("+lora") else {}
    run = tmp_path / "run"
    over = small_overrides(tiny_dir(tmp_path / "model", "llama"), train, run, **{
        "rollout.engine": "vllm", "optim.lr": 5e-2, "rewards": "[{name: test_varied}]", "model.dtype": "float32",
        "model.device": "cpu", "rollout.max_new_tokens": 6, "train.distributed": mode.split("+")[0], "train.steps": 3,
        "train.dist_timeout_s": 120, "train.check_rewards": "false", "train.batch_advice": "false", **VLLM_OPTS, **lora})
    out = tmp_path / "out"
    torchrun.run(2, torchrun.program("vllm_push", out, *over), timeout=420)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["version"] == 3                      # pushed after each of the 3 steps
        assert r["moved"] > 1e-3                      # the weights did train
        assert r["vllm"] == r["trained"]              # greedy tokens: vLLM's equal the trained model's
        assert r["adapters"] == bool(lora)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["rollout/staleness"] == 0 for row in rows)
