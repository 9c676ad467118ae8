"""RUN_DIR/health_config.json: the health monitor writes the thresholds it runs with, and the report
draws those (config.yaml only for a run directory without the file); grpokit.monitor imports
nothing from grpokit.train."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from grpokit.monitor.health import HEALTH_CONFIG_FILE, HealthConfig, HealthMonitor
from grpokit.monitor.report import health_thresholds, load_run, write_report

from .synth import healthy_history, write_run_dir

MONITOR = Path(__file__).resolve().parents[2] / "grpokit" / "monitor"


def _kl_figure(page: str) -> str:
    return re.search(r'<figure class="?signal[^>]*data-metric="kl/ref">(.*?)</figure>', page, re.S).group(1)


def test_the_monitor_writes_its_config_at_the_first_step(tmp_path):
    cfg = HealthConfig.model_validate({"kl_climbing": {"kl_high": 0.37, "action": "stop"}})
    mon = HealthMonitor(cfg, tmp_path / "run", print_fn=lambda s: None)
    assert not (tmp_path / "run").exists()          # not at construction: the trainer may still move
    mon.update(1, {"kl/ref": 0.01})                  # an earlier run's output aside
    saved = json.loads((tmp_path / "run" / HEALTH_CONFIG_FILE).read_text())
    assert HealthConfig.model_validate(saved) == cfg
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [HEALTH_CONFIG_FILE]   # no temp file
    HealthMonitor(HealthConfig(), None).update(1, {"kl/ref": 0.01})   # no run dir: nothing written


def test_the_report_draws_the_thresholds_written_in_the_run_dir(tmp_path):
    hist = healthy_history(40)
    config = {"health": {"kl_climbing": {"kl_high": None}}, "algorithm": {"kl": {"target_high": 25.0}}}
    write_run_dir(tmp_path, hist, config=config, sample_every=0)
    mon = HealthMonitor(HealthConfig.model_validate({"kl_climbing": {"kl_high": 0.37, "unit": "token"}}),
                        tmp_path, print_fn=lambda s: None)
    mon.update(0, {})
    data = load_run(tmp_path)
    th = health_thresholds(data.config, data.health_config)
    assert th.origin == HEALTH_CONFIG_FILE and th.health.kl_climbing.kl_high == 0.37
    assert set(th.filled) == {"kl_climbing.kl_high"}      # null in config.yaml: the trainer filled it in
    page = write_report(tmp_path).read_text()
    assert "kl_high 0.37: alarm after 10 steps above" in _kl_figure(page)
    assert "kl_high 25" not in page                        # not what config.yaml alone would give
    assert "(the run's health config: health_config.json)" in page
    assert "health.kl_climbing.kl_high not set: the KL controller&#x27;s upper target" in page


def test_an_old_run_dir_or_a_broken_file_falls_back_to_config_yaml(tmp_path):
    hist = healthy_history(40)
    config = {"health": {"kl_climbing": {"kl_high": None}},
              "algorithm": {"kl": {"target_high": 0.25, "target_low": 0.01, "target_unit": "token"}}}
    write_run_dir(tmp_path, hist, config=config, sample_every=0)
    page = write_report(tmp_path).read_text()           # no health_config.json
    assert "kl_high 0.25: alarm after" in _kl_figure(page) and "health config: config.yaml)" in page
    (tmp_path / HEALTH_CONFIG_FILE).write_text("{not json")
    data = load_run(tmp_path)
    assert data.health_config is None and any(HEALTH_CONFIG_FILE in n for n in data.notes)
    assert "kl_high 0.25: alarm after" in _kl_figure(write_report(tmp_path).read_text())
    th = health_thresholds(config, {"kl_climbing": {"kl_hig": 1.0}})   # does not validate: said why
    assert th.health.kl_climbing.kl_high == 0.25 and "does not validate" in th.origin


@pytest.mark.parametrize("over", [
    [], ["algorithm.kl.target_high=30", "guard.ref_tolerance=0.003"],
    ["algorithm.kl.controller=ziegler", "algorithm.kl.controller_args={target: 0.2}"],
    ["algorithm.kl.controller=fixed"], ["algorithm.kl.target_unit=token", "algorithm.kl.target_low=0.01"],
    ["health.kl_climbing.kl_high=0.5", "health.no_signal.window=7"],
])
def test_a_fresh_run_draws_what_config_yaml_alone_gives(tmp_path, over):
    """The thresholds the trainer's monitor writes are those the report used to work out from
    config.yaml, so a fresh run's report is unchanged."""
    from grpokit.config import dump_config, load_config
    from grpokit.train import build_health

    cfg = load_config(None, [f"train.run_dir={tmp_path}", *over])
    build_health(cfg).update(0, {})
    config = yaml.safe_load(dump_config(cfg))
    saved = json.loads((tmp_path / HEALTH_CONFIG_FILE).read_text())
    new, old = health_thresholds(config, saved), health_thresholds(config)
    if new.health.kl_climbing.kl_high is None:     # no level test: its unit is not drawn or used
        old.health.kl_climbing.unit = new.health.kl_climbing.unit
    assert (new.health, new.filled) == (old.health, old.filled)


def test_the_monitor_package_imports_nothing_from_train():
    for path in MONITOR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n == "grpokit.train" or n.startswith("grpokit.train.")]
            assert not bad, f"{path.relative_to(MONITOR.parent)} imports {bad}"
