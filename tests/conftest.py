import os
import random

import numpy as np
import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def demo_warm_dir(tmp_path_factory):
    """The quick demo's warm-started model (seed 0), trained once per session; a test copies it into
    its own run directory (`grpokit.demo.run_demo` reuses a warm start found there)."""
    from grpokit.demo import DemoSettings, warm_start
    from grpokit.tasks.arithmetic import ArithmeticTask

    s = DemoSettings.quick(0)
    task = ArithmeticTask(seed=0, carry_frac=s.carry_frac, teacher_correct=s.teacher_correct, heldout=s.heldout)
    return warm_start(s, task, tmp_path_factory.mktemp("demo_warm"), say=lambda *a: None)
