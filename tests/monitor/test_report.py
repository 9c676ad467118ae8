"""The HTML run report: content, escaping, robustness to missing/malformed input, speed."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import subprocess

import numpy as np
import pytest

from grpokit.monitor.health import Alarm, HealthConfig, HealthMonitor
from grpokit.monitor.report import _alarm_marks, group_signals, load_run, write_report

from .synth import healthy_history, write_run_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIG = {"model": {"path": "tiny-lm"}, "algo": {"name": "grpo", "group_size": 8},
          "health": {"kl_climbing": {"kl_high": 0.2, "high_steps": 5}}}


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


@pytest.fixture
def run_dir(tmp_path):
    """60 steps; KL runs away after step 40 (alarms from the real monitor); NaN/inf values."""
    hist = healthy_history(60, eval_every=10)
    for row in hist:
        if row["step"] > 40:
            row["kl/ref"] = 0.3
    hist[5]["loss/total"] = math.nan
    hist[6]["optim/grad_norm"] = math.inf
    path = tmp_path / "run"
    mon = HealthMonitor(HealthConfig.model_validate(CONFIG["health"]), path, print_fn=lambda s: None)
    for row in hist:
        mon.update(row["step"], row)
    return write_run_dir(path, hist, config=CONFIG)


def test_report_contents(run_dir):
    out = write_report(run_dir)
    assert out == run_dir / "report.html"
    page = out.read_text()
    # one embedded PNG per namespace, each a real PNG
    n_namespaces = len(group_signals(load_run(run_dir).metrics))
    images = _images(page)
    assert n_namespaces >= 12 and len(images) == n_namespaces
    assert all(img.startswith(PNG_MAGIC) for img in images)
    # health summary in words, from alarms.jsonl: the jump to 0.3 at step 41 fires the trend test
    # at step 43 (tau reaches 0.5), then KL > kl_high for 5 steps fires the level test at 45..60
    assert "kl_climbing (warn) fired 17 times, from step 43 to step 60" in page
    # samples: escaped, from early / middle / late files, with the reward breakdown
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;step 10&#x27;)&lt;/script&gt;" in page
    assert "a &lt; b &amp;&amp; c &gt; d" in page
    for phase in ("early", "middle", "late"):
        assert f"<td>{phase}<br>" in page
    assert all(f"<br>step {s}</td>" in page for s in (10, 40, 60))  # files 1, 6 // 2 + 1, 6
    assert "correct: 1" in page and "format: 0.5" in page and "none (error?)" in page
    # config as YAML
    assert "group_size: 8" in page and "kl_high: 0.2" in page and "high_steps: 5" in page
    # self-contained: no network resource, no script
    assert not re.search(r"(src|href)=\"?(https?:)?//", page)
    assert "<link" not in page and "@import" not in page


def test_alarm_marks_on_the_metrics_each_rule_reads():
    alarms = [Alarm("kl_climbing", s, "warn", "", "", 0.3) for s in (5, 6, 7, 12)]
    alarms.append(Alarm("ref_drift", 9, "stop", "", "", 1.0))
    alarms.append(Alarm("someone_elses_rule", 3, "warn", "", "", 1.0))  # unknown: no plot
    marks = _alarm_marks(alarms)
    assert marks["kl/ref"] == [("kl_climbing", "warn", [(5, 7), (12, 12)])]
    assert marks["ref/integrity_drift"] == [("ref_drift", "stop", [(9, 9)])]
    assert set(marks) == {"kl/ref", "ref/integrity_drift"}


def test_signal_grouping_orders_namespaces_and_skips_non_numbers():
    rows = [{"step": 1, "time": 0.0, "zeta/x": 1.0, "reward/fn/mean": 1.0, "reward/mean": 0.5,
             "loss/total": math.nan, "note": "text", "flag": True, "plain": 2}]
    assert group_signals(rows) == {
        "reward": ["reward/mean", "reward/fn/mean"], "loss": ["loss/total"],
        "other": ["plain"], "zeta": ["zeta/x"],
    }


def test_empty_run_dir_says_so(tmp_path):
    page = write_report(tmp_path).read_text()
    assert "No metrics were recorded" in page
    assert "No samples were recorded" in page
    assert "No config.yaml" in page
    assert "Healthy: no alarm fired." in page
    assert "metrics.jsonl is missing" in page
    assert _images(page) == []


def test_empty_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "samples").mkdir()
    page = write_report(tmp_path).read_text()
    assert "No metrics were recorded" in page and "No samples were recorded" in page


def test_missing_run_dir_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")


def test_malformed_lines_are_skipped_and_mentioned(tmp_path):
    rows = [json.dumps({"step": t, "loss/total": 1.0 / t, "reward/mean": 0.1 * t}) for t in range(1, 6)]
    rows.insert(2, '{"step": 3, "loss/total": 0.3')  # truncated write
    rows.insert(4, "[1, 2]")
    rows.append(json.dumps({"step": 3, "loss/total": 9.0}))  # resumed run re-logs step 3
    rows.append(json.dumps({"loss/total": 9.0}))  # no step
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "alarms.jsonl").write_text('{"name": "no_signal", "step": 2, "severity": "warn"}\nnot json\n')
    (tmp_path / "config.yaml").write_text("a: [1, 2\n")
    data = load_run(tmp_path)
    assert [r["step"] for r in data.metrics] == [1, 2, 3, 4, 5]
    assert data.metrics[2]["loss/total"] == 9.0  # the later row wins
    page = write_report(tmp_path).read_text()
    assert "metrics.jsonl line 3: malformed JSON, skipped." in page
    assert "metrics.jsonl line 5: not a JSON object, skipped." in page
    assert "alarms.jsonl line 2: malformed JSON, skipped." in page
    assert "1 step(s) logged twice" in page and "without a numeric" in page
    assert "config.yaml is not valid YAML" in page and "a: [1, 2" in page
    assert "no_signal (warn) fired once, at step 2" in page
    assert len(_images(page)) == 2  # loss, reward


def test_all_nan_metric_and_single_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss/total": NaN, "kl/ref": Infinity, "reward/mean": 0.5}\n'
    )
    page = write_report(tmp_path).read_text()
    assert len(_images(page)) == 3 and "1 steps logged" in page


def test_report_handles_500_steps_and_40_metrics(tmp_path):
    # speed is measured, not asserted: a timed unit test fails on a loaded machine
    hist = healthy_history(500)
    for row in hist:
        row.update({f"reward/fn{j}/mean": float(np.sin(row["step"] / (10 + j))) for j in range(4)})
    assert len({k for k in hist[19] if k not in ("step", "time")}) == 42
    alarms = [Alarm("kl_climbing", s, "warn", "m", "a", 0.1).to_dict() for s in range(300, 500)]
    write_run_dir(tmp_path, hist, alarms=alarms, config=CONFIG, sample_every=50)
    page = write_report(tmp_path).read_text()
    assert "kl_climbing" in page and len(_images(page)) >= 5


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="Chromium not on PATH (apt-get install chromium)")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    import matplotlib.image as mpimg

    report = write_report(run_dir)
    shot = tmp_path / "shot.png"
    cmd = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
        "--window-size=1200,3000", "--disable-background-networking", "--disable-component-update",
        "--no-first-run", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", report.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.is_file(), f"no screenshot; chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    img = mpimg.imread(shot)  # [H, W, C] floats in 0..1
    assert img.shape[:2] == (3000, 1200)
    rgb = img[..., :3]
    assert rgb.std() > 0.05  # not one flat colour
    assert (rgb.min(axis=-1) < 0.5).mean() > 0.005  # some dark pixels: text and plot lines


def test_many_bad_lines_are_counted_not_listed(tmp_path):
    lines = ["garbage"] * 50 + [json.dumps({"step": 1, "reward/mean": 0.5})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    notes = load_run(tmp_path).notes
    assert sum("malformed JSON" in n for n in notes) == 5
    assert "metrics.jsonl: 45 more bad line(s) skipped." in notes


def test_duplicate_alarm_rows_from_a_resumed_run_count_once(tmp_path):
    rows = [Alarm("no_signal", s, "warn", f"m{s}", "a", 1.0).to_dict() for s in (4, 5, 5, 6)]
    write_run_dir(tmp_path, healthy_history(6), alarms=rows, sample_every=0)
    assert [a.step for a in load_run(tmp_path).alarms] == [4, 5, 6]
    assert "no_signal (warn) fired 3 times, from step 4 to step 6" in write_report(tmp_path).read_text()


@pytest.mark.parametrize("n_files,phases", [(1, ["only"]), (2, ["early", "late"]),
                                            (5, ["early", "middle", "late"])])
def test_sample_phases(tmp_path, n_files, phases):
    write_run_dir(tmp_path, healthy_history(10 * n_files), sample_every=10)
    data = load_run(tmp_path)
    assert [p for p, _, _ in data.samples] == phases and data.n_sample_files == n_files
    assert data.samples[-1][1] == 10 * n_files  # the late phase is the last file
    assert all(len(rows) == 6 for _, _, rows in data.samples)


def test_guard_events_are_listed_with_their_causes(tmp_path):
    write_run_dir(tmp_path, healthy_history(8), sample_every=0)
    events = [
        {"event": "skip", "step": 3, "cause": "non-finite log-probs <NaN>", "updates_skipped": 1, "updates": 1},
        {"event": "skip", "step": 4, "cause": "non-finite gradients", "updates_skipped": 1, "updates": 2},
        {"event": "rollback", "step": 4, "to": "step_000002", "cause": "non-finite gradients", "lr_factor": 0.5},
    ]
    (tmp_path / "guard.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    page = write_report(tmp_path).read_text()
    assert "2 step(s) with skipped updates, 1 rollback(s)" in page
    assert "non-finite log-probs &lt;NaN&gt;" in page
    assert "1 of 2 mini-batch updates skipped" in page and "rolled back to step_000002" in page


def test_a_run_without_guard_events_says_so(tmp_path):
    write_run_dir(tmp_path, healthy_history(4), sample_every=0)
    assert "The non-finite guard skipped no update." in write_report(tmp_path).read_text()
