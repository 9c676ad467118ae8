"""`grpokit compare`: presets side by side from one warm start, a table, JSON rows and a chart."""

import json

import pytest

from grpokit.compare import compare
from grpokit.demo import DemoSettings


@pytest.mark.slow
def test_compare_writes_table_rows_and_chart(tmp_path):
    small = DemoSettings(hidden=32, layers=1, heads=2, warm_steps=30, heldout=24)
    own = tmp_path / "cfg" / "my_dapo.yaml"          # a preset given as a YAML file: named by its stem
    own.parent.mkdir()
    own.write_text("base: dapo\n")
    out = compare(["grpo", str(own)], seeds=[0, 1], steps=3, eval_every=2, run_dir=tmp_path / "runs",
                  settings=small, say=lambda *a: None)
    tmp_path = tmp_path / "runs"
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert sorted((r["preset"], r["seed"]) for r in rows) == [("grpo", 0), ("grpo", 1), ("my_dapo", 0), ("my_dapo", 1)]
    for r in rows:
        assert 0.0 <= r["greedy_accuracy"] <= 100.0 and r["wall_seconds"] > 0
        assert [s for s, *_ in r["curve"]] == [1, 2, 3]
        assert (tmp_path / f"{r['preset']}-seed{r['seed']}" / "metrics.jsonl").is_file()
    table = (tmp_path / "compare.md").read_text()
    assert "| grpo |" in table and "| my_dapo |" in table and "24 held-out" in table
    # the table's means are the rows' means
    g = [r["greedy_accuracy"] for r in rows if r["preset"] == "grpo"]
    assert f"{sum(g) / 2:.1f}%" in out["table"].splitlines()[2]
    png = (tmp_path / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the warm start is shared: one model per seed
    assert len(list(tmp_path.glob("warm-*"))) == 2


@pytest.mark.slow
def test_compare_runs_carry_the_health_monitor(tmp_path):
    """Each preset's run is built like the CLI's: a reward that scores nothing raises the health
    monitor's rewards_missing alarm in that run's directory."""
    from tests.fixtures import alarm_names

    small = DemoSettings(hidden=32, layers=1, heads=2, warm_steps=10, heldout=8)
    own = tmp_path / "no_reward.yaml"
    own.write_text("base: grpo\nrewards: [{name: test_no_reward}]\ntrain: {check_rewards: false}\n")
    compare([str(own)], seeds=[0], steps=2, eval_every=2, run_dir=tmp_path / "runs", settings=small,
            say=lambda *a: None)
    assert "rewards_missing" in alarm_names(tmp_path / "runs" / "no_reward-seed0")
