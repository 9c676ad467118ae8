"""Metric sinks: RUN_DIR/metrics.jsonl always; TensorBoard, Weights & Biases and MLflow on request.

`MetricSink` writes one JSON row per step to RUN_DIR/metrics.jsonl and hands the same step and the
same numeric values to its backends (`TensorBoardSink`, `WandbSink`, `MLflowSink`). `open_sink`
builds it from `cfg.monitor`; `check_sinks` fails at start, in one line naming the pip extra, when a
requested backend's package is missing. A backend opens its run at the first `write` (nothing is
written before a step is logged), and one that fails mid-run is turned off with a warning:
metrics.jsonl is the record, the backends are views of it.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse

from grpokit.errors import ConfigError

log = logging.getLogger("grpokit.monitor")

SINK_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
"""Valid `monitor.sinks` entries; `jsonl` is always on."""

_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}
"""sink -> (module imported, grpokit pip extra that installs it)."""


def _import(sink: str):
    """Import the package behind `sink`, or raise a one-line ConfigError naming the pip extra."""
    module, extra = _PACKAGES[sink]
    try:
        return importlib.import_module(module)
    except ImportError:
        msg = f"monitor.sinks lists '{sink}' but the {module} package is not installed: pip install 'grpokit[{extra}]'"
    except Exception as exc:  # noqa: BLE001 - a broken install: still one line, at start
        msg = f"monitor.sinks lists '{sink}' but {module} cannot be imported ({type(exc).__name__}: {exc})"
    raise ConfigError(msg.replace("\n", " "))


def requested_sinks(cfg) -> tuple[list[str], bool]:
    """(backends to open, whether TensorBoard is only `when installed`) from `cfg.monitor.sinks`:
    unset means TensorBoard when it is installed; a listed backend is required."""
    names = cfg.monitor.sinks
    if names is None:
        return ["tensorboard"], True
    return [n for n in names if n != "jsonl"], False


def check_sinks(cfg) -> None:
    """Raise a one-line ConfigError now if a requested backend's package is missing (called before
    the model is loaded, so a run never stops on it later)."""
    names, soft = requested_sinks(cfg)
    for name in names:
        if not (soft and name == "tensorboard"):
            _import(name)


def open_sink(run_dir: Path, cfg) -> "MetricSink":
    """The trainer's sink: metrics.jsonl plus the backends `cfg.monitor.sinks` names, each given the
    resolved config and `cfg.monitor`'s project and run name."""
    names, soft = requested_sinks(cfg)
    m = cfg.monitor
    config = cfg.model_dump(mode="json")
    backends: list[Backend] = []
    for name in names:
        if name == "tensorboard":
            backends.append(TensorBoardSink(run_dir, required=not soft))
        elif name == "wandb":
            backends.append(WandbSink(run_dir, project=m.project, run_name=m.run_name, mode=m.wandb_mode,
                                      config=config))
        elif name == "mlflow":
            backends.append(MLflowSink(run_dir, experiment=m.project, run_name=m.run_name, config=config))
    return MetricSink(run_dir, tensorboard=False, backends=backends)


class Backend:
    """A view of the metrics in another tool. `write` gets the step and the numeric metrics of one
    metrics.jsonl row (NaN/inf included; each backend decides what to do with them)."""

    name = "backend"

    def write(self, step: int, metrics: dict[str, float], wall_time: float) -> None:
        raise NotImplementedError

    def resume_after(self, step: int) -> None:
        """The run resumes from the checkpoint of `step`: the next write is step + 1."""

    def close(self) -> None:
        pass


class MetricSink:
    """Appends one JSON row per step to RUN_DIR/metrics.jsonl and passes the row's numbers to each
    backend (`tensorboard=True` adds TensorBoard when it is installed). Nothing is written to disk
    before the first `write`, so a run directory holds no output of a run that has not logged a
    step yet. A backend that raises is turned off with one warning; the JSONL row is written first."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, backends: list[Backend] | tuple = ()):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.backends: list[Backend] = list(backends)
        if tensorboard and not any(isinstance(b, TensorBoardSink) for b in self.backends):
            self.backends.insert(0, TensorBoardSink(self.run_dir, required=False))

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows written after the checkpoint's step (they will be redone); the
        backends learn the step (they cannot take back what they logged)."""
        truncate_jsonl(self.path, step)
        for b in list(self.backends):
            self._call(b, "resume_after", step)

    def write(self, step: int, metrics: dict) -> None:
        """Append `{"step": step, "time": unix seconds, **metrics}`; numbers go to the backends."""
        now = time.time()
        row = {"step": step, "time": now,
               **{k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for b in list(self.backends):
            self._call(b, "write", step, numbers, now)

    def close(self) -> None:
        for b in list(self.backends):
            self._call(b, "close")

    def _call(self, backend: Backend, method: str, *args) -> None:
        try:
            getattr(backend, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a logging backend never stops training
            log.warning("%s sink turned off after an error (metrics.jsonl is unaffected): %s: %s",
                        backend.name, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.backends.remove(backend)
            if method != "close":
                try:
                    backend.close()
                except Exception:  # noqa: BLE001
                    pass


class TensorBoardSink(Backend):
    """Scalars to RUN_DIR/tb (finite values only: TensorBoard has no NaN/inf marker). Not
    `required`: silently off when TensorBoard is not installed."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, *, required: bool = True):
        if required:
            _import("tensorboard")
        self.run_dir = Path(run_dir)
        self.enabled = True
        self.tb = None                 # the SummaryWriter, opened at the first write

    def write(self, step, metrics, wall_time):
        if self.tb is None and self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.enabled = False
        if self.tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step, walltime=wall_time)

    def close(self):
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _run_name(run_dir: Path, run_name: str) -> str:
    return run_name or Path(run_dir).resolve().name


class WandbSink(Backend):
    """Weights & Biases: `run.log(metrics, step=step)` with the metrics.jsonl keys; NaN/inf are
    logged as such (W&B stores them). Mode: `mode`, else WANDB_MODE, else `offline` (files under
    RUN_DIR/wandb/offline-run-*; `wandb sync` uploads them later). Directory: WANDB_DIR when set, else
    RUN_DIR. Each start of the trainer is its own W&B run named `run_name` (a resumed one has
    `resumed_from_step` in its config: the earlier run keeps the steps it logged after the
    checkpoint). The trainer's stdout is not captured (console off)."""

    name = "wandb"

    def __init__(self, run_dir: Path, *, project: str = "", run_name: str = "", mode: str | None = None,
                 config: dict | None = None):
        self.wandb = _import("wandb")
        self.run_dir = Path(run_dir)
        self.project = project or os.environ.get("WANDB_PROJECT") or "grpokit"
        self.run_name = _run_name(run_dir, run_name)
        self.mode = mode or (None if os.environ.get("WANDB_MODE") else "offline")   # None: wandb reads it
        self.config = dict(config or {})
        self.run = None
        self.resumed_from: int | None = None

    def resume_after(self, step):
        self.resumed_from = step

    def _open(self):
        wandb = self.wandb
        directory = Path(os.environ.get("WANDB_DIR") or self.run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        if self.resumed_from is not None:
            config["resumed_from_step"] = self.resumed_from
        self.run = wandb.init(project=self.project, name=self.run_name, dir=str(directory), mode=self.mode,
                              config=config, reinit="create_new", settings=wandb.Settings(console="off"))

    def write(self, step, metrics, wall_time):
        if self.run is None:
            self._open()
        self.run.log(metrics, step=step)

    def close(self):
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")


def mlflow_key(key: str) -> str:
    """The MLflow name of a metric: MLflow allows only letters, digits, `_ - . /` and spaces in
    names, so `@` becomes `_at_` (`eval/pass@1` -> `eval/pass_at_1`) and any other character `_`."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class MLflowSink(Backend):
    """MLflow through `MlflowClient` (no global active run): one `log_batch` per step with the step,
    the row's time and the keys of `mlflow_key`; NaN/inf are logged as such (the file store keeps
    them; MLflow's database stores turn inf into +-1.8e308). Tracking URI: MLFLOW_TRACKING_URI when
    set, else the file store RUN_DIR/mlruns (MLflow 3 keeps the file store in maintenance mode behind
    MLFLOW_ALLOW_FILE_STORE, which is set to true for this process unless already set). Experiment
    `experiment` (default `grpokit`), run `run_name`, the resolved config as the artifact
    config.yaml. Each start of the trainer is its own MLflow run (a resumed one is tagged
    `grpokit.resumed_from_step`); a run left open by a crash is marked FAILED at exit."""

    name = "mlflow"
    BATCH = 1000                       # MLflow's limit of metrics per log_batch

    def __init__(self, run_dir: Path, *, experiment: str = "", run_name: str = "", config: dict | None = None):
        self.mlflow = _import("mlflow")
        self.run_dir = Path(run_dir)
        self.experiment = experiment or "grpokit"
        self.run_name = _run_name(run_dir, run_name)
        self.config = config
        self.client = None
        self.run_id: str | None = None
        self.resumed_from: int | None = None

    @property
    def tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or (self.run_dir / "mlruns").resolve().as_uri()

    def resume_after(self, step):
        self.resumed_from = step

    def _open(self):
        from mlflow.tracking import MlflowClient
        uri = self.tracking_uri
        if urlparse(uri).scheme in ("", "file"):          # a file store (a plain path is one too)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = client.create_experiment(self.experiment)
            except Exception:  # noqa: BLE001 - created meanwhile by another run
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        tags = {"grpokit.run_dir": str(self.run_dir.resolve())}
        if self.resumed_from is not None:
            tags["grpokit.resumed_from_step"] = str(self.resumed_from)
        run = client.create_run(exp_id, run_name=self.run_name, tags=tags)
        self.client, self.run_id = client, run.info.run_id
        atexit.register(self._failed_at_exit)
        if self.config is not None:
            client.log_dict(self.run_id, self.config, "config.yaml")

    def write(self, step, metrics, wall_time):
        from mlflow.entities import Metric
        if self.run_id is None:
            self._open()
        ts = int(wall_time * 1000)
        batch = [Metric(mlflow_key(k), v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(batch), self.BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + self.BATCH])

    def _end(self, status: str) -> None:
        if self.run_id is not None:
            run_id, self.run_id = self.run_id, None
            atexit.unregister(self._failed_at_exit)
            self.client.set_terminated(run_id, status=status)

    def _failed_at_exit(self) -> None:
        try:
            self._end("FAILED")
        except Exception:  # noqa: BLE001
            pass

    def close(self):
        self._end("FINISHED")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file and rename it over `path`: a process killed meanwhile leaves the
    old file or the new one, never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the rows of a JSONL log whose `step` is after `step` (on resume), atomically. Rows that
    do not parse are dropped too (a line cut by a kill)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= step:
                keep.append(line + "\n")
        except (ValueError, TypeError, AttributeError):
            continue
    atomic_write_text(path, "".join(keep))
