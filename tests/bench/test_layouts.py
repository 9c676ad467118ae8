"""bench/layouts.py (what bench/gpu/run.sh times on a GPU) runs end to end on CPU with a tiny model:
each layout trains, its step is split into generation, training and sync, and a layout whose
engine is missing is skipped with the reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import layouts  # noqa: E402


@pytest.mark.slow
def test_the_layouts_bench_runs_its_smoke_configuration(tmp_path):
    out = tmp_path / "layouts.json"
    assert layouts.main(["--smoke", "--layouts", "hf,server,vllm,trl", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["results"]) >= {"hf", "server"}
    for name in ("hf", "server"):
        r = res["results"][name]
        assert r["steps"] == 2 and r["trajectories_per_s"] > 0 and r["tokens_per_s"] > 0
        parts = r["generation_s"] + r["training_s"] + r["sync_s"]
        assert 0 < parts <= r["step_s"] * 1.05                      # the parts fit in the step
    assert res["results"]["hf"]["sync_s"] == 0 and res["results"]["server"]["sync_s"] > 0
    assert res["results"]["server"]["sync_mb"] > 0
    assert res["results"]["hf"]["tokens_per_s_vs_hf"] == pytest.approx(1.0)
    assert "no --trl-python given" in res["skipped"]["trl"]
    if importlib.util.find_spec("vllm") is None:
        assert "vLLM is not installed" in res["skipped"]["vllm"]
