"""`grpokit train` writes RUN_DIR/report.html at the end of every run, also one that stops with an
error; a report that cannot be written never hides that error."""

import pytest

from grpokit.cli import main
from grpokit.train.run import Trainer
from tests.fixtures import small_overrides, tiny_run_inputs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_inputs(tmp_path_factory.mktemp("cli"))[:3]


def _args(setup, name: str) -> list[str]:
    root, model_dir, train = setup
    return ["train", *small_overrides(model_dir, train, root / name, **{"rewards": "[{name: test_varied}]"})]


@pytest.fixture
def diverging(monkeypatch):
    """Training stops with an error in its second step (as a diverged run or a strict reference
    check does)."""
    real = Trainer.step

    def step(self):
        if self.step_idx == 1:
            raise RuntimeError("training diverged (injected)")
        return real(self)
    monkeypatch.setattr(Trainer, "step", step)


def test_train_writes_the_report(setup, capsys):
    assert main(_args(setup, "ok")) == 0
    report = setup[0] / "ok" / "report.html"
    assert report.is_file() and "2 steps logged" in report.read_text()
    assert f"report: {report}" in capsys.readouterr().out


def test_a_run_that_raises_still_writes_its_report(setup, diverging):
    with pytest.raises(RuntimeError, match="training diverged"):
        main(_args(setup, "raises"))
    report = setup[0] / "raises" / "report.html"
    assert report.is_file() and "1 steps logged" in report.read_text()


def test_a_report_failure_does_not_hide_the_training_error(setup, diverging, monkeypatch):
    import grpokit.monitor.report as report_mod

    def broken(run_dir):
        raise OSError("disk full")
    monkeypatch.setattr(report_mod, "write_report", broken)
    with pytest.raises(RuntimeError, match="training diverged"):
        main(_args(setup, "both_fail"))
    assert not (setup[0] / "both_fail" / "report.html").exists()
