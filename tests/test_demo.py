"""End to end: `grpokit demo --quick` must measurably teach the tiny model."""

import json
import shutil

import pytest

from grpokit.demo import run_demo


@pytest.mark.slow
def test_quick_demo_gains_accuracy(tmp_path, demo_warm_dir):
    shutil.copytree(demo_warm_dir, tmp_path / "demo" / demo_warm_dir.name)   # the session's warm start
    s = run_demo(quick=True, run_dir=tmp_path / "demo", say=lambda *a: None, progress=False)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved["accuracy_after"] == s["accuracy_after"]
    for key in ("accuracy_before", "accuracy_after", "sampled_accuracy_before", "sampled_accuracy_after",
                "teacher_accuracy", "steps", "wall_seconds"):
        assert key in saved
    # GRPO goes beyond what the warm start imitated
    assert s["accuracy_after"] >= s["accuracy_before"] + 20.0   # 38-65 points over seeds 0-5 (docs/demo.md)
    assert (tmp_path / "demo" / "grpo" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_the_demo_run_carries_the_health_monitor(tmp_path, demo_warm_dir):
    """The demo builds its run like the CLI does: a reward that scores nothing raises the health
    monitor's rewards_missing alarm in the demo's run directory, and the report is written."""
    from tests.fixtures import alarm_names

    shutil.copytree(demo_warm_dir, tmp_path / "demo" / demo_warm_dir.name)
    run_demo(quick=True, run_dir=tmp_path / "demo", say=lambda *a: None, progress=False,
             overrides=["train.steps=2", "rewards=[{name: test_no_reward}]", "train.check_rewards=false"])
    grpo = tmp_path / "demo" / "grpo"
    assert "rewards_missing" in alarm_names(grpo)
    assert (grpo / "report.html").is_file()
