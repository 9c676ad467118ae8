"""The HTML run report: the leading health signals (order, smoothing, alarm bands, not logged),
constant metrics folded into a table, content, escaping, robustness to missing/malformed input,
long runs."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import statistics
import subprocess

import numpy as np
import pytest
import yaml

from grpokit.monitor.health import Alarm, HealthConfig, HealthMonitor, LengthExplosionConfig, length_explosion
from grpokit.monitor.report import (_alarm_marks, _columns, alarm_bands, centred_average, downsample,
                                    group_signals, health_thresholds, kl_target_high, length_alarm_level,
                                    load_run, signal_lines, smoothing_window, write_report)

from .synth import healthy_history, write_run_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIG = {"model": {"path": "tiny-lm"}, "algo": {"name": "grpo", "group_size": 8},
          "health": {"kl_climbing": {"kl_high": 0.2, "high_steps": 5}}}


# The health signals the report leads with, in this order (the trainer logs held-out accuracy as
# eval/pass@1: grpokit/train/evaluate.py, docs/metrics.md).
SIGNALS = ("loss/policy", "kl/ref", "reward/mean", "completion/length_mean", "advantage/std",
           "loss/token_mean", "eval/pass@1")


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def _figures(page: str) -> dict[str, str]:
    """metric -> the HTML of its leading-signal figure."""
    return dict(re.findall(r'<figure class="?signal[^>]*data-metric="([^"]+)">(.*?)</figure>', page, re.S))


def _plotted_metrics(page: str) -> set[str]:
    """The metrics of the namespace figures below the signals (their alt text lists them)."""
    out: set[str] = set()
    for alt in re.findall(r'<img alt="[^"]* metrics: ([^"]*)"', page):
        out.update(alt.split(", "))
    return out


def _constant_table(page: str) -> dict[str, str]:
    m = re.search(r"<details class=constant>(.*?)</details>", page, re.S)
    return dict(re.findall(r"<tr><td><code>([^<]+)</code></td><td class=num>([^<]*)</td>", m.group(1))) if m else {}


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
    # one PNG per health signal, then one per namespace of the other metrics that vary (optim/lr
    # and guard/skipped_steps never change: they are in the constant table), each a real PNG
    n_namespaces = len(group_signals(load_run(run_dir).metrics))
    images = _images(page)
    assert n_namespaces >= 12 and len(images) == len(SIGNALS) + n_namespaces
    assert all(img.startswith(PNG_MAGIC) for img in images)
    assert set(_constant_table(page)) == {"optim/lr", "guard/skipped_steps"}
    # the KL alarm on the KL plot, its kl_high band from config.yaml
    assert "alarm: kl_climbing" in _figures(page)["kl/ref"] and "kl_high 0.2" in _figures(page)["kl/ref"]
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
    assert marks["kl/ref_seq"] == marks["kl/ref"]       # the level test may read the per-completion KL
    assert set(marks) == {"kl/ref", "kl/ref_seq", "ref/integrity_drift"}


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
    # kl/ref and reward/mean lead (an inf is logged: plotted, with its cross); loss/total is one NaN
    assert len(_images(page)) == 2 and "1 steps logged" in page
    assert "1 non-finite" in _figures(page)["kl/ref"]
    assert _constant_table(page) == {"loss/total": "NaN"}
    assert sum("not logged" in f for f in _figures(page).values()) == 5


def test_report_renders_1000_steps_and_40_metrics(tmp_path):
    # speed is measured, not asserted: a timed unit test fails on a loaded machine
    hist = healthy_history(1000)
    for row in hist:
        row.update({f"reward/fn{j}/mean": float(np.sin(row["step"] / (10 + j))) for j in range(4)})
    assert len({k for k in hist[19] if k not in ("step", "time")}) == 42
    alarms = [Alarm("kl_climbing", s, "warn", "m", "a", 0.1).to_dict() for s in range(600, 1000)]
    write_run_dir(tmp_path, hist, alarms=alarms, config=CONFIG, sample_every=100)
    page = write_report(tmp_path).read_text()
    figures = _figures(page)
    assert list(figures) == list(SIGNALS)
    assert all("<img" in f for f in figures.values())
    # 1000 values: a centred average over 41; pass@1 has 50 eval points: over 5
    assert "centred average of 41 values" in figures["kl/ref"]
    assert "centred average of 5 values" in figures["eval/pass@1"]
    assert "alarm: kl_climbing" in figures["kl/ref"]
    images = _images(page)
    assert len(images) >= len(SIGNALS) + 10 and all(img.startswith(PNG_MAGIC) for img in images)
    # the page stays small: plotted lines are downsampled, plots are small PNGs
    assert len(page.encode()) < 2_500_000


def test_downsample_keeps_spikes_and_ends():
    rng = np.random.default_rng(0)
    x = np.arange(1, 5001, dtype=float)
    y = rng.standard_normal(5000)
    y[1234], y[4321] = 50.0, -60.0
    xd, yd = downsample(x, y, 600)
    assert len(xd) <= 600 and np.all(np.diff(xd) > 0)
    assert xd[0] == 1 and xd[-1] == 5000
    assert 50.0 in yd and -60.0 in yd
    assert set(zip(xd, yd)) <= set(zip(x, y))  # only real points
    short = np.arange(10.0)
    assert downsample(short, short, 600)[0] is short  # short lines are drawn as they are


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="Chromium not on PATH (make test-report installs it)")
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


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="Chromium not on PATH (make test-report installs it)")
def test_a_hacked_runs_report_shows_the_alarm_in_headless_chromium(tmp_path):
    """The report of a run whose reward climbs while held-out pass@1 falls, rendered by Chromium:
    the page it builds (its DOM after load) names the reward_hacking alarm with its advice, and
    draws every plot (each <img> decoded to its full size)."""
    hist = healthy_history(80, eval_every=10)
    for row in hist:
        t = row["step"]
        row["reward/mean"] = 0.2 + 0.7 * t / 80                      # climbing
        for k in ("eval/pass@1", "eval/mean@k"):
            if k in row:
                row[k] = max(0.0, 0.6 - 0.5 * t / 80)                  # while held-out accuracy falls
    path = tmp_path / "run"
    mon = HealthMonitor(HealthConfig.model_validate(CONFIG["health"]), path, print_fn=lambda s: None)
    fired = {a.name for row in hist for a in mon.update(row["step"], row)}
    assert "reward_hacking" in fired
    report = write_report(write_run_dir(path, hist, config=CONFIG))
    probe = (tmp_path / "probe.html")
    probe.write_text(report.read_text().replace(
        "</body>", "<script>window.addEventListener('load', () => {document.body.setAttribute('data-drawn', "
                   "[...document.images].filter(i => i.complete && i.naturalWidth > 100).length + '/' + "
                   "document.images.length);});</script></body>"))
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", "--virtual-time-budget=5000",
           "--disable-background-networking", "--disable-component-update", "--no-first-run", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", probe.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert "reward_hacking" in dom and "tighten the answer checker" in dom    # the alarm and its advice
    drawn = re.search(r'data-drawn="(\d+)/(\d+)"', dom)
    assert drawn and int(drawn.group(1)) == int(drawn.group(2)) > 10, drawn and drawn.group(0)


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


# --------------------------------------------------------------------------------------------
# The leading health signals


def test_the_health_signals_lead_the_report_in_order(run_dir):
    page = write_report(run_dir).read_text()
    starts = [page.index(f'data-metric="{k}"') for k in SIGNALS]
    assert starts == sorted(starts)  # in the documented order
    # before every other section and every other plot
    first_other_img = min(m.start() for m in re.finditer(r'<img alt="[^"]* metrics: ', page))
    for later in ('<h2 id="health">', "<h3>Non-finite guard</h3>", '<h2 id="metrics">', "<h2>Samples</h2>",
                  "<h2>Config</h2>"):
        assert starts[-1] < page.index(later)
    assert starts[-1] < first_other_img
    assert page.index('<h2 id="signals">') < starts[0]
    assert page.count("<h2") - page.count('<h2 id="signals">') == page[starts[-1]:].count("<h2")
    # each leading signal is plotted once, up front, and not again among the other metrics
    assert not set(SIGNALS) & _plotted_metrics(page)


def test_a_signal_the_run_did_not_log_says_so(tmp_path):
    hist = healthy_history(30, eval_every=1000)  # no evaluation step
    for row in hist:
        del row["kl/ref"]  # beta = 0: no reference, no KL
    write_run_dir(tmp_path, hist, sample_every=0)
    figures = _figures(write_report(tmp_path).read_text())
    assert list(figures) == list(SIGNALS)
    for key in ("kl/ref", "eval/pass@1"):
        assert "not logged" in figures[key] and "<img" not in figures[key]
    for key in set(SIGNALS) - {"kl/ref", "eval/pass@1"}:
        assert "<img" in figures[key] and "not logged" not in figures[key]


def _centred_mean_by_loop(y, w):
    """The centred moving average written out: the mean of the values at most w // 2 away."""
    h = w // 2
    return np.array([statistics.fmean(y[max(0, i - h): i + h + 1]) for i in range(len(y))])


def test_smoothing_is_a_centred_moving_average():
    # by hand: window 3, cut at the ends
    np.testing.assert_allclose(centred_average(np.array([1.0, 2.0, 3.0, 4.0, 10.0]), 3),
                               [1.5, 2.0, 3.0, 17 / 3, 7.0])
    rng = np.random.default_rng(3)
    for n, w, offset in ((40, 5, 0.0), (1000, 41, 0.0), (7, 5, 0.0), (200, 51, 0.0), (1000, 41, 1e9)):
        y = offset + rng.standard_normal(n).cumsum()
        expected = _centred_mean_by_loop(y, w)
        np.testing.assert_allclose(centred_average(y, w) - offset, expected - offset, rtol=1e-9, atol=1e-6)
    # the window the report uses: 5 at 40 steps, 41 at 1000, none below 8 values
    assert [smoothing_window(n) for n in (3, 7, 8, 40, 200, 1000, 5000)] == [1, 1, 5, 5, 9, 41, 51]
    # the plotted lines skip the steps without a finite value; the average runs over the rest
    steps = np.arange(1, 101, dtype=float)
    raw = rng.standard_normal(100)
    raw[[4, 50, 51]] = np.nan
    (x, y), smooth, w = signal_lines(steps, raw)
    assert w == 5 and len(x) == 97 and 5 not in x and 51 not in x
    np.testing.assert_array_equal(smooth[0], x)
    np.testing.assert_allclose(smooth[1], _centred_mean_by_loop(raw[~np.isnan(raw)], 5))
    assert signal_lines(steps[:5], np.ones(5))[1] is None  # 5 values: the raw line only


def test_constant_metrics_are_folded_into_a_table_not_plotted(tmp_path):
    hist = healthy_history(40, eval_every=10)
    for i, row in enumerate(hist):
        row.update({
            "reward/nonfinite": 0.0, "kl/beta": 0.0, "errs/count": 0, "broken/x": math.nan,
            "broken/y": math.inf, "sign/zero": -0.0 if i % 2 else 0.0,
            "reward/sometimes_nan": math.nan if i == 7 else 0.0,  # one NaN: not constant
            "reward/jumps": 1.0 if i == 30 else 0.0,  # one change: not constant
            "advantage/std": 0.0,  # a health signal that never changes is still plotted up front
        })
        if row["step"] % 10 == 0:
            row["eval/const"] = 0.25
    write_run_dir(tmp_path, hist, sample_every=0)
    page = write_report(tmp_path).read_text()
    table = _constant_table(page)
    assert table == {
        "reward/nonfinite": "0", "kl/beta": "0", "errs/count": "0", "broken/x": "NaN", "broken/y": "Infinity",
        "sign/zero": "0", "eval/const": "0.25", "optim/lr": "1e-06", "guard/skipped_steps": "0",
    }
    assert "<summary>9 constant metric(s)" in page and "<details class=constant>" in page
    assert "<details class=constant open" not in page  # collapsed
    plotted = _plotted_metrics(page)
    assert not set(table) & plotted
    assert {"reward/sometimes_nan", "reward/jumps", "reward/std"} <= plotted
    # namespaces with nothing but constants get no figure
    assert "<h3>broken</h3>" not in page and "<h3>errs</h3>" not in page and "<h3>sign</h3>" not in page
    assert "<img" in _figures(page)["advantage/std"] and "advantage/std" not in table
    row = re.search(r"<code>eval/const</code></td><td class=num>0.25</td><td>(\d+)</td>", page)
    assert row and row.group(1) == "4"  # logged at 4 of the 40 steps


def _bands(config, hist):
    th = health_thresholds(config)
    steps = np.array([r["step"] for r in hist], dtype=float)
    keys = sorted({k for r in hist for k in r if k not in ("step", "time")})
    return th, alarm_bands(th.health, steps, _columns(hist, keys))


def test_alarm_bands_come_from_the_run_config(tmp_path):
    hist = healthy_history(60, eval_every=10)
    config = {"health": {"kl_climbing": {"kl_high": 0.2, "min_kl": 0.07},
                         "no_signal": {"adv_std_eps": 0.01, "max_frac_zero_std": 0.8},
                         "length_explosion": {"factor": 3.0, "min_increase": 0.0},
                         "entropy_collapse": {"action": "off"}}}
    th, bands = _bands(config, hist)
    assert th.origin == "config.yaml"
    kl = {b.field: b for b in bands["kl/ref"]}
    assert kl["kl_climbing.kl_high"].value == 0.2 and kl["kl_climbing.kl_high"].side == "above"
    # with a band the trend test's floor is half its bound, in its unit (min_kl is for runs without one)
    assert "kl_climbing.min_kl" not in kl
    assert kl["kl_climbing.band_floor"].value == pytest.approx(0.1) and kl["kl_climbing.band_floor"].side is None
    assert [(b.value, b.side) for b in bands["advantage/std"]] == [(0.01, "below")]
    assert [b.value for b in bands["group/frac_zero_std"]] == [0.8]
    assert "policy/entropy" not in bands  # the rule is off: nothing to draw
    # the length level: 3x the median of the 20 values before the last 5 (min_increase 0)
    lengths = np.array([r["completion/length_mean"] for r in hist])
    (level,) = [b.value for b in bands["completion/length_mean"]]
    assert np.isnan(level[:14]).all()
    for i in (14, 30, 59):
        assert level[i] == pytest.approx(3.0 * statistics.median(lengths[max(0, i - 24): i - 4]))
    # and the page says which thresholds it drew, from where
    write_run_dir(tmp_path, hist, config=config, sample_every=0)
    page = write_report(tmp_path).read_text()
    assert "kl_high 0.2: alarm after 10 steps above" in _figures(page)["kl/ref"]
    assert "adv_std_eps 0.01" in _figures(page)["advantage/std"]
    assert "3x the median" in _figures(page)["completion/length_mean"]
    assert "Alarm thresholds drawn (the run's health config: config.yaml)" in page
    assert "— health.no_signal.adv_std_eps</span>" in page


def test_alarm_bands_fall_back_to_defaults(tmp_path):
    hist = healthy_history(30)
    th, bands = _bands(None, hist)
    assert th.origin.startswith("defaults")
    assert [b.value for b in bands["advantage/std"]] == [1e-4]
    assert [b.field for b in bands["kl/ref"]] == ["kl_climbing.min_kl"]  # no kl_high by default
    th, _ = _bands({"health": {"no_signal": {"adv_std_epz": 1}}}, hist)  # unknown key: defaults, said why
    assert th.origin.startswith("defaults") and "adv_std_epz" in th.origin
    write_run_dir(tmp_path, hist, sample_every=0)
    page = write_report(tmp_path).read_text()
    assert "adv_std_eps 0.0001" in _figures(page)["advantage/std"]
    assert "(the run's health config: defaults (no readable config.yaml))" in page


def test_kl_high_and_ref_tolerance_filled_in_as_the_trainer_does():
    from grpokit.config import Config

    # config.yaml holds every field: an unset kl_high is null there, and the trainer used the
    # KL controller's upper target; an unset ref_drift.tolerance is its default (guard's is used)
    dumped = yaml.safe_load(yaml.safe_dump(Config().model_dump(mode="json")))
    dumped["algorithm"]["kl"]["target_high"] = 15.0
    dumped["guard"]["ref_tolerance"] = 0.003
    th = health_thresholds(dumped)
    assert th.health.kl_climbing.kl_high == 15.0 and th.health.ref_drift.tolerance == 0.003
    assert th.health.kl_climbing.unit == "sequence"                     # the default KL target unit
    assert set(th.filled) == {"kl_climbing.kl_high", "ref_drift.tolerance"}
    cols = {k: (np.zeros(3), np.ones(3, bool)) for k in ("kl/ref", "kl/ref_seq")}
    bands = alarm_bands(th.health, np.arange(3.0), cols)
    assert [b.value for b in bands["kl/ref_seq"] if b.field == "kl_climbing.kl_high"] == [15.0]
    assert not [b for b in bands.get("kl/ref", []) if b.field == "kl_climbing.kl_high"]   # not on the per-token plot
    assert [b.value for b in bands["kl/ref_seq"] if b.field == "kl_climbing.band_floor"] == [7.5]   # the trend floor
    dumped["algorithm"]["kl"].update(target_unit="token", target_low=0.01, target_high=0.15)
    th = health_thresholds(dumped)
    bands = alarm_bands(th.health, np.arange(3.0), cols)
    assert [b.value for b in bands["kl/ref"] if b.field == "kl_climbing.kl_high"] == [0.15]
    dumped["health"]["kl_climbing"]["kl_high"] = 0.4  # set by the user: kept
    assert health_thresholds(dumped).health.kl_climbing.kl_high == 0.4


@pytest.mark.parametrize("kl", [
    {}, {"beta": 0.0}, {"controller": "fixed"}, {"controller": "ziegler", "controller_args": {"target": 0.07}},
    {"controller": "warmup", "controller_args": {"steps": 5, "inner": {"kind": "adaptive", "beta": 0.05, "low": 0.01, "high": 0.3}}},
    {"controller": "schedule", "controller_args": {"inner": {"kind": "ziegler", "beta": 0.1, "target": 0.2}}},
    {"controller": "adaptive", "target_high": 25.0}, {"target_unit": "token", "target_low": 0.01, "target_high": 0.25},
])
def test_kl_target_high_agrees_with_the_trainer(kl):
    from grpokit.config import config_from_dict
    from grpokit.config.kl_control import kl_target_high as trainer_kl_target_high

    data = {"algorithm": {"kl": kl}}
    assert kl_target_high(data) == trainer_kl_target_high(config_from_dict(data))


def test_length_band_is_where_the_length_rule_fires():
    rng = np.random.default_rng(5)
    lengths = np.concatenate([100 + 5 * rng.standard_normal(30), np.linspace(110, 400, 30),
                              400 + 10 * rng.standard_normal(10)])
    for p in (LengthExplosionConfig(), LengthExplosionConfig(factor=1.5, recent=3, min_increase=30)):
        level = length_alarm_level(lengths, p)
        hist = [{"step": i + 1, "completion/length_mean": float(v)} for i, v in enumerate(lengths)]
        fired = [length_explosion(hist[: i + 1], p) is not None for i in range(len(hist))]
        crossed = [bool(np.isfinite(level[i]) and statistics.median(lengths[max(0, i + 1 - p.recent): i + 1]) >= level[i])
                   for i in range(len(hist))]
        assert fired == crossed and any(fired) and not all(fired)
