"""MetricSink: each row carries its wall-clock time; truncation on resume is atomic."""

import json
import time

import pytest

from grpokit.monitor import sinks
from grpokit.monitor.sinks import MetricSink, read_metrics


def test_each_row_has_its_step_and_time(tmp_path):
    sink = MetricSink(tmp_path, tensorboard=False)
    t0 = time.time()
    sink.write(1, {"reward/mean": 0.5})
    sink.write(2, {"reward/mean": 0.7})
    t1 = time.time()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward/mean"] == 0.7
    assert all(t0 <= r["time"] <= t1 for r in rows) and rows[0]["time"] <= rows[1]["time"]


def test_truncate_after_replaces_the_file_whole(tmp_path, monkeypatch):
    """The kept rows go to a temporary file that is renamed over metrics.jsonl: a process killed
    before the rename leaves every row, never half a file."""
    sink = MetricSink(tmp_path, tensorboard=False)
    for step in range(1, 6):
        sink.write(step, {"loss/total": float(step)})
    before = sink.path.read_text()

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")
    monkeypatch.setattr(sinks.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        sink.truncate_after(2)
    assert sink.path.read_text() == before
    monkeypatch.undo()
    sink.truncate_after(2)
    assert [json.loads(x)["step"] for x in sink.path.read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]   # no temporary file left


def test_nothing_is_written_before_the_first_row(tmp_path):
    MetricSink(tmp_path / "run", tensorboard=True).close()
    assert list((tmp_path / "run").iterdir()) == []
