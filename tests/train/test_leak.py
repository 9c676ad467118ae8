"""Nothing accumulates from step to step: over 10 training steps of a tiny model, the live tensors
(count and bytes) and the resident memory stay where they were after the warm-up steps.

Tensors are counted exactly through the garbage collector (a tensor kept per step, such as a
retained autograd graph, a growing history or a cached batch, shows as a count that grows). The
resident size is read after returning freed heap memory to the system (`malloc_trim`), which
makes it a stable measure on a busy machine; its check is coarse (a tiny model's step allocates
little), the tensor count is the exact one."""

import ctypes
import gc
import warnings

import pytest
import torch

from grpokit.config import load_config
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


def _is_tensor(obj) -> bool:
    # the object's type, not isinstance: isinstance reads `__class__`, which a lazy module proxy
    # (openai's, httpx's: imported when their test modules are collected) answers by importing its
    # module, so counting tensors once imported some 1,600 modules and grew the resident size ~58 MB
    # between two steps of this test
    return issubclass(type(obj), torch.Tensor)


def live_tensors() -> tuple[int, int]:
    """(number of live tensors, bytes of their distinct storages)."""
    gc.collect()
    n, storages = 0, {}
    with warnings.catch_warnings():      # isinstance on some deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if _is_tensor(o)]
    for obj in tensors:
        n += 1
        if obj.device.type != "meta":
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return n, sum(storages.values())


def rss_mb() -> float:
    """Resident memory of this process after freed heap pages are returned to the system."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root, model_dir, train, _ = tiny_run_inputs(tmp_path_factory.mktemp("leak"))
    # fixed-length completions (EOS ignored), so every step holds tensors of the same shapes
    cfg = load_config(None, small_overrides(model_dir, train, root / "run", **{
        "train.steps": 10, "rollout.ignore_eos": True, "rollout.max_new_tokens": 6,
        "algorithm.kl.beta": 0.05, "rewards": "[{name: test_varied}]", "optim.micro_batch_size": 4,
        # the reference log-prob cache holds tensors by design (bounded, LRU: tests/train/test_lora.py)
        "algorithm.kl.ref_cache": 0}))
    torch.manual_seed(0)
    return build_trainer(cfg, health=True)


def test_ten_steps_hold_no_more_tensors_or_memory_than_two(trainer):
    counts, rss = {}, []
    for i in range(1, 11):
        m = trainer.step()
        trainer.step_idx += 1
        assert m["optim/grad_norm"] > 0                       # every step updates the weights
        if i in (2, 6, 10):                                   # the optimizer's state exists from step 1
            counts[i] = live_tensors()
        rss.append(rss_mb())
    assert counts[2] == counts[6] == counts[10], counts
    # a step of this model moves well under 1 MB; 8 steps that each kept one would add many
    assert max(rss[2:]) - rss[1] < 8.0, rss
