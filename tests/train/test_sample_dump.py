"""The sample dumps (RUN_DIR/samples/step_N.jsonl, `train.sample_every`): every completion of the
step with what it was paid and why, checked against the run itself and recomputed by hand: the
weighted total from the per-reward scores, the group-normalised advantage from the group's
totals, the length from the completion's tokens."""

import json
import statistics

import pytest
import torch

from grpokit.config import load_config
from grpokit.train import build_trainer
from tests.fixtures import small_overrides, tiny_run_inputs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root, model_dir, train, _ = tiny_run_inputs(tmp_path_factory.mktemp("dump"))
    cfg = load_config(None, small_overrides(model_dir, train, root / "run", **{
        "rewards": "[{name: test_varied, weight: 0.5}, {name: exact_match, weight: 2.0}]",
        "train.steps": 4, "train.sample_every": 2, "rollout.max_new_tokens": 6}))
    torch.manual_seed(0)
    tr = build_trainer(cfg, health=False)
    seen = {}
    tr.train(progress=lambda step, m: seen.setdefault(step, tr.last_batch))
    return tr, seen


def _rows(tr, step):
    return [json.loads(x) for x in (tr.run_dir / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def test_dumps_are_written_every_n_steps_with_every_completion(run):
    tr, seen = run
    assert sorted(p.name for p in (tr.run_dir / "samples").iterdir()) == ["step_000002.jsonl", "step_000004.jsonl"]
    for step in (2, 4):
        rows, batch = _rows(tr, step), seen[step]
        assert len(rows) == len(batch) == tr.cfg.rollout.batch_size
        assert [r["completion"] for r in rows] == batch.completions
        assert all(r["step"] == step for r in rows)
        assert [r["prompt"] for r in rows] == [tr.encoder.text(x["prompt"]) for x in batch.rows]
        assert [r["answer"] for r in rows] == [x["answer"] for x in batch.rows]
        groups = [r["group"] for r in rows]
        assert all(groups.count(g) == tr.cfg.rollout.group_size for g in set(groups))


def test_a_dumped_row_adds_up(run):
    """total = 0.5 x test_varied + 2 x exact_match; advantage = (total - group mean) / (group
    std, Bessel, + 1e-6), 0 in a group of equal totals; length = the completion's tokens (EOS too)."""
    tr, seen = run
    rows = _rows(tr, 4)
    for r in rows:
        assert r["reward"] == pytest.approx(0.5 * r["rewards"]["test_varied"] + 2.0 * r["rewards"]["exact_match"])
        assert r["rewards"]["exact_match"] == float(r["completion"].strip() == r["answer"].strip())
    for g in {r["group"] for r in rows}:
        members = [r for r in rows if r["group"] == g]
        totals = [m["reward"] for m in members]
        for m in members:
            want = 0.0 if len(set(totals)) == 1 else (
                (m["reward"] - statistics.mean(totals)) / (statistics.stdev(totals) + 1e-6))
            assert m["advantage"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    tok = tr.tokenizer
    for r, ids in zip(rows, seen[4].completion_ids):
        n = r["length"]
        assert tok.decode(ids[:n].tolist(), skip_special_tokens=True) == r["completion"]
        assert r["finish_reason"] in ("eos", "length")
        assert (r["finish_reason"] == "length") == (n == tr.cfg.rollout.max_new_tokens and
                                                    int(ids[n - 1]) != tok.eos_token_id)
