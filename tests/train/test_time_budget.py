"""`train.max_minutes`: training stops after the step that exhausts the budget, and saves."""

import json

from grpokit.config import load_config
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


def test_time_budget_stops_after_the_step_that_exhausts_it(tmp_path):
    root, model_dir, train, _ = tiny_run_inputs(tmp_path, n_train=32)
    run = tmp_path / "run"
    over = small_overrides(model_dir, train, run, **{"train.steps": 5, "train.max_minutes": 1e-6,
                                                     "train.batch_advice": False})
    trainer = build_trainer(load_config(None, over), health=False)
    trainer.train()
    assert trainer.step_idx == 1
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "checkpoints" / "step_000001").is_dir()

    unlimited = build_trainer(load_config(None, small_overrides(model_dir, train, tmp_path / "run2",
                                                                **{"train.steps": 3})), health=False)
    unlimited.train()
    assert unlimited.step_idx == 3
