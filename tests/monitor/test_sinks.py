"""MetricSink: each row carries its wall-clock time; truncation on resume is atomic; sink names and
packages are checked at start; W&B (offline) and MLflow (file store) hold the rows' numbers at their
steps, read back with each library's own reader."""

import json
import logging
import math
import os
import struct
import sys
import time
from pathlib import Path

import pytest

from grpokit.config import ConfigError, load_config
from grpokit.monitor import sinks
from grpokit.monitor.sinks import (Backend, MetricSink, MLflowSink, WandbSink, check_sinks, mlflow_key, open_sink,
                                   read_metrics)
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


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


# --------------------------------------------------------------------------- sink names and packages


@pytest.mark.parametrize("value, fragment", [
    ("[jsonl,wandbb]", "unknown sink 'wandbb' (did you mean 'wandb'?); valid sinks: jsonl, tensorboard, wandb, mlflow"),
    ("neptune", "unknown sink 'neptune'; valid sinks: jsonl, tensorboard, wandb, mlflow"),
    ("3", "must be a list of sink names (jsonl, tensorboard, wandb, mlflow)"),
])
def test_an_unknown_sink_is_a_one_line_config_error(value, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"monitor.sinks={value}"])
    msg = str(err.value)
    assert msg.startswith("config key 'monitor.sinks': ") and fragment in msg
    assert "\n" not in msg


@pytest.mark.parametrize("value, names", [
    ("[wandb,mlflow]", ["jsonl", "wandb", "mlflow"]),
    ("wandb, mlflow,wandb", ["jsonl", "wandb", "mlflow"]),     # a comma-separated string; duplicates dropped
    ("[mlflow,jsonl]", ["jsonl", "mlflow"]),                   # jsonl always, first
    ("[]", ["jsonl"]),
])
def test_sink_lists_are_normalised(value, names):
    assert load_config(None, [f"monitor.sinks={value}"]).monitor.sinks == names


def test_train_tensorboard_is_a_deprecated_alias():
    assert load_config(None, []).monitor.sinks is None       # default: jsonl, TensorBoard when installed
    with pytest.warns(FutureWarning, match="train.tensorboard is deprecated; use monitor.sinks"):
        cfg = load_config(None, ["train.tensorboard=false"])
    assert cfg.monitor.sinks == ["jsonl"] and cfg.train.tensorboard is None
    with pytest.warns(FutureWarning):
        cfg = load_config(None, ["train.tensorboard=true", "monitor.sinks=[mlflow]"])
    assert cfg.monitor.sinks == ["jsonl", "mlflow", "tensorboard"]
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="contradicts monitor.sinks"):
        load_config(None, ["train.tensorboard=false", "monitor.sinks=[tensorboard]"])


@pytest.mark.parametrize("sink, extra", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_missing_package_is_one_line_at_start_naming_the_extra(tmp_path, monkeypatch, sink, extra):
    monkeypatch.setitem(sys.modules, sink, None)              # `import sink` now raises ImportError
    cfg = load_config(None, [f"monitor.sinks=[{sink}]", f"train.run_dir={tmp_path}",
                             f"model.path={tmp_path / 'no-model'}"])
    for call in (lambda: check_sinks(cfg), lambda: open_sink(tmp_path, cfg), lambda: build_trainer(cfg)):
        with pytest.raises(ConfigError) as err:               # build_trainer: before the (missing) model
            call()
        assert str(err.value) == (f"monitor.sinks lists '{sink}' but the {sink} package is not installed: "
                                  f"pip install 'grpokit[{extra}]'")
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_by_default_only_when_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    check_sinks(cfg)                                          # unset sinks: no error without TensorBoard
    sink = open_sink(tmp_path, cfg)
    sink.write(1, {"loss/total": 1.0})
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


class _Failing(Backend):
    name = "failing"

    def __init__(self):
        self.calls = 0

    def write(self, step, metrics, wall_time):
        self.calls += 1
        raise ConnectionError("tracking server unreachable\nsecond line")


def test_a_failing_backend_is_turned_off_and_the_jsonl_row_kept(tmp_path, caplog):
    bad = _Failing()
    sink = MetricSink(tmp_path, tensorboard=False, backends=[bad])
    with caplog.at_level(logging.WARNING, logger="grpokit.monitor"):
        for step in (1, 2):
            sink.write(step, {"loss/total": float(step)})
    sink.close()
    assert bad.calls == 1 and sink.backends == []
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == ("failing sink turned off after an error (metrics.jsonl is unaffected): "
                       "ConnectionError: tracking server unreachable")


# --------------------------------------------------------------------------- W&B and MLflow round trips

NAN, INF = float("nan"), float("inf")
ROWS = [  # step, metrics: exact binary fractions, NaN/inf, an `@` key, a non-number (JSONL only)
    (1, {"loss/total": 0.5, "reward/mean": 0.25, "eval/pass@1": 0.75, "note": "text"}),
    (2, {"loss/total": 0.125, "reward/mean": NAN, "optim/grad_norm": INF}),
    (3, {"loss/total": -1.5, "reward/mean": 1.0, "optim/grad_norm": -INF, "guard/skipped_steps": 2}),
]


def _history(rows) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} of the numbers in `rows`, as the backends receive them."""
    out: dict[str, list] = {}
    for step, metrics in rows:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                out.setdefault(k, []).append((step, float(v)))
    return out


def _same(a: dict, b: dict) -> bool:
    """Equal histories, NaN equal to NaN."""
    def norm(h):
        return {k: [(s, "nan" if math.isnan(v) else v) for s, v in pts] for k, pts in h.items()}
    return norm(a) == norm(b)


def _wandb_records(path: Path):
    """The records of an offline W&B run file (RUN_DIR/wandb/offline-run-*/run-*.wandb), parsed with
    wandb's own protobuf `Record`. The file is a `:W&B` header (ident, magic 0xBEE1, version) and then
    LevelDB-log records in 32 KiB blocks: 7-byte header (crc32c, length, type: 1 full, 2 first,
    3 middle, 4 last), zero padding at a block's end."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            parts = chunk
        else:
            parts += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_runs(wandb, run_dir: Path) -> list[tuple[dict, dict, dict]]:
    """(history {key: [(step, value)]}, config, run info) of each offline run under run_dir, oldest
    first. `wandb.teardown()` first: `finish()` returns before the service has written the file."""
    wandb.teardown()
    runs = []
    for path in run_dir.glob("wandb/offline-run-*/run-*.wandb"):
        history: dict[str, list] = {}
        config, info = {}, {}
        for r in _wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                for item in r.history.item:
                    key = "/".join(item.nested_key) or item.key
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((r.history.step.num, json.loads(item.value_json)))
            elif kind == "run":
                info = {"name": r.run.display_name, "project": r.run.project,
                        "start": r.run.start_time.ToNanoseconds()}
                config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
        runs.append((history, config, info))
    return sorted(runs, key=lambda run: run[2]["start"])


def _children() -> list[str]:
    """Live child processes of this test process."""
    me, out = str(os.getpid()), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.append(stat.parent.name)
    return out


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B with no account, no network and nothing outside tmp_path; its service process is shut down
    afterwards and must be gone."""
    wandb = pytest.importorskip("wandb", reason="the wandb sink needs wandb: pip install 'grpokit[wandb]'")
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_RESUME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    before = set(_children())
    yield wandb
    wandb.teardown()
    deadline = time.time() + 10
    while set(_children()) - before and time.time() < deadline:
        time.sleep(0.05)
    assert not set(_children()) - before, "a W&B process outlived the test"


def _log_rows(run_dir, backend) -> None:
    """ROWS through a MetricSink with `backend` beside metrics.jsonl, then closed."""
    sink = MetricSink(run_dir, tensorboard=False, backends=[backend])
    for step, metrics in ROWS:
        sink.write(step, metrics)
    sink.close()


def test_wandb_offline_round_trip(tmp_path, wandb_offline):
    run_dir = tmp_path / "runs" / "grpo"
    _log_rows(run_dir, WandbSink(run_dir, config={"seed": 7}))
    [(history, config, info)] = _wandb_runs(wandb_offline, run_dir)
    assert _same(history, _history(ROWS)), history
    assert (info["name"], info["project"], config["seed"]) == ("grpo", "grpokit", 7)
    assert "resumed_from_step" not in config
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_wandb_resume_is_a_new_run_from_the_checkpoint_step(tmp_path, wandb_offline):
    run_dir = tmp_path / "run"
    _log_rows(run_dir, WandbSink(run_dir, run_name="exp"))
    again = MetricSink(run_dir, tensorboard=False, backends=[WandbSink(run_dir, run_name="exp")])
    again.truncate_after(2)                                   # what Trainer.resume does
    redone = [(3, {"loss/total": 4.0}), (4, {"loss/total": 8.0})]
    for step, metrics in redone:
        again.write(step, metrics)
    again.close()
    [(old, _, _), (new, config, info)] = _wandb_runs(wandb_offline, run_dir)
    assert _same(old, _history(ROWS))                         # the earlier run keeps what it logged
    assert _same(new, _history(redone)) and config["resumed_from_step"] == 2 and info["name"] == "exp"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.fixture
def mlflow_local(monkeypatch):
    """MLflow with no tracking server and no telemetry; MLFLOW_ALLOW_FILE_STORE, which the sink sets
    for its file store, is restored afterwards."""
    pytest.importorskip("mlflow", reason="the mlflow sink needs mlflow: pip install 'grpokit[mlflow]'")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")         # recorded, so the sink's value is undone
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    from mlflow.tracking import MlflowClient
    yield MlflowClient


def _mlflow_runs(client, experiment: str = "grpokit"):
    exp = client.get_experiment_by_name(experiment)
    return sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def _mlflow_history(client, run, keys) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for k in keys:
        points = client.get_metric_history(run.info.run_id, mlflow_key(k))
        out[k] = sorted((m.step, m.value) for m in points)
    return out


def test_mlflow_file_store_round_trip(tmp_path, mlflow_local):
    run_dir = tmp_path / "runs" / "grpo"
    _log_rows(run_dir, MLflowSink(run_dir, config={"seed": 7}))
    client = mlflow_local(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    [run] = _mlflow_runs(client)
    expected = _history(ROWS)
    assert _same(_mlflow_history(client, run, expected), expected)
    assert set(run.data.metrics) == {mlflow_key(k) for k in expected} and "eval/pass_at_1" in run.data.metrics
    assert run.info.run_name == "grpo" and run.info.status == "FINISHED"
    assert "grpokit.resumed_from_step" not in run.data.tags
    rows = read_metrics(run_dir)                              # MLflow's time is the JSONL row's
    stamps = {m.step: m.timestamp for m in client.get_metric_history(run.info.run_id, "loss/total")}
    assert stamps == {r["step"]: int(r["time"] * 1000) for r in rows}
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert "seed: 7" in config.read_text()


def test_mlflow_resume_is_a_new_run_and_the_tracking_uri_is_respected(tmp_path, mlflow_local, monkeypatch):
    elsewhere = (tmp_path / "store").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    run_dir = tmp_path / "run"
    _log_rows(run_dir, MLflowSink(run_dir, experiment="exp", run_name="r"))
    again = MetricSink(run_dir, tensorboard=False, backends=[MLflowSink(run_dir, experiment="exp", run_name="r")])
    again.truncate_after(2)
    again.write(3, {"loss/total": 4.0})
    again.close()
    assert not (run_dir / "mlruns").exists()
    client = mlflow_local(tracking_uri=elsewhere)
    old, new = _mlflow_runs(client, "exp")
    assert _same(_mlflow_history(client, old, ["loss/total"]), {"loss/total": [(1, 0.5), (2, 0.125), (3, -1.5)]})
    assert _same(_mlflow_history(client, new, ["loss/total"]), {"loss/total": [(3, 4.0)]})
    assert new.data.tags["grpokit.resumed_from_step"] == "2" and new.info.run_name == "r"


def test_mlflow_keys_keep_only_what_mlflow_allows():
    assert mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_key("eval/mean@k") == "eval/mean_at_k"
    assert mlflow_key("reward/my fn:v2/mean") == "reward/my fn_v2/mean"
    assert mlflow_key("loss/total") == "loss/total"


def test_nothing_is_written_before_the_first_row_by_any_sink(tmp_path, wandb_offline, mlflow_local):
    """The trainer opens a sink, closes it, moves an earlier run aside and opens another: a sink
    that was never written to leaves no W&B or MLflow run behind."""
    cfg = load_config(None, ["monitor.sinks=[wandb,mlflow]", f"train.run_dir={tmp_path / 'run'}"])
    open_sink(tmp_path / "run", cfg).close()
    assert list((tmp_path / "run").iterdir()) == []


def test_the_trainer_logs_the_same_rows_to_every_sink_and_resumes(tmp_path, wandb_offline, mlflow_local):
    """Tiny training with monitor.sinks=[wandb,mlflow]: 2 steps, then a resume from the step-2
    checkpoint for a third. Each start is a W&B / MLflow run of its own; together they hold exactly
    the numbers of metrics.jsonl, at the same steps."""
    root, model_dir, train, _ = tiny_run_inputs(tmp_path, n_train=16)
    run_dir = root / "runs" / "tiny"
    for steps, resume in ((2, False), (3, True)):
        cfg = load_config(None, small_overrides(model_dir, train, run_dir, **{
            "monitor.sinks": "[wandb,mlflow]", "train.steps": steps, "train.save_every": 2}))
        build_trainer(cfg, health=False).train(resume=resume)
    rows = [(r["step"], {k: v for k, v in r.items() if k not in ("step", "time")}) for r in read_metrics(run_dir)]
    assert [s for s, _ in rows] == [1, 2, 3] and len(_history(rows)) > 10
    first, second = _history(rows[:2]), _history(rows[2:])
    [(h1, c1, i1), (h2, c2, i2)] = _wandb_runs(wandb_offline, run_dir)
    assert _same(h1, first) and _same(h2, second)
    assert i1["name"] == i2["name"] == "tiny" and c1["monitor"]["sinks"] == ["jsonl", "wandb", "mlflow"]
    assert "resumed_from_step" not in c1 and c2["resumed_from_step"] == 2
    client = mlflow_local(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    r1, r2 = _mlflow_runs(client)
    assert _same(_mlflow_history(client, r1, first), first) and _same(_mlflow_history(client, r2, second), second)
    assert r1.info.status == r2.info.status == "FINISHED" and r2.data.tags["grpokit.resumed_from_step"] == "2"
