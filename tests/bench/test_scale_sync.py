"""bench/scale.py (`make bench-scale`) and bench/sync.py run end to end with the small model and few
steps: each writes its results, and their figures are the kind the docs quote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import scale  # noqa: E402
import sync  # noqa: E402


@pytest.mark.slow
@pytest.mark.distributed
def test_the_scale_bench_runs_one_and_two_processes(tmp_path):
    out = tmp_path / "scale.json"
    scale.main(["--size", "small", "--steps", "2", "--max-new-tokens", "4", "--work", str(tmp_path / "w"),
                "--out", str(out)])
    res = json.loads(out.read_text())
    a, b = res["results"]
    assert (a["world"], a["threads"], b["world"], b["threads"]) == (1, 2, 2, 1)
    assert a["step_s"] > 0 and b["step_s"] > 0 and len(b["peak_rss_mb_per_rank"]) == 2
    assert b["train_state_mb_per_rank"] == pytest.approx(a["train_state_mb_per_rank"] / 2, rel=0.05)   # FSDP2 halves it


@pytest.mark.slow
def test_the_sync_bench_measures_both_kinds_of_sync(tmp_path):
    from tests.fixtures import tiny_model_dir

    out = tmp_path / "sync.json"
    assert sync.main(["--model", str(tiny_model_dir(tmp_path / "model")), "--rounds", "2", "--rank", "4",
                      "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    full, small = res["median"]["full"], res["median"]["adapters"]
    assert full["s"] > 0 and small["s"] > 0 and small["mb"] < full["mb"]     # checksums were checked each round
