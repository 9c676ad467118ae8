"""The reward determinism check: unseeded rewards are named, deterministic built-ins pass (also in
fresh checker processes), the fresh-process pass really restarts the checkers, a reward failing on
one call only is reported; the probe batch's layout; checker pool restarts."""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest

from grpokit.rewards import RewardSet
from grpokit.rewards import math as M
from grpokit.rewards._workers import WorkerPool
from grpokit.rewards.determinism import check_determinism, check_rows, probe_batch, same

ROWS = [{"prompt": "What is 2+2?", "answer": "4", "level": 1},
        {"prompt": [{"role": "user", "content": "Half of one?"}], "answer": "\\frac{1}{2}", "level": 2}]

PID_CHECKER = ("import json, os, sys\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
               "    req = json.loads(line)\n"
               "    print(json.dumps({'id': req['id'], 'pid': os.getpid()}), flush=True)\n")




def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_an_unseeded_random_reward_is_named(temp_rewards):
    temp_rewards("t_det_unseeded", lambda prompts, completions, **c: [random.random() for _ in completions])
    rs = RewardSet.from_specs([{"name": "t_det_unseeded"}, {"name": "exact_match"}])
    warnings = check_determinism(rs, *probe_batch(ROWS), fresh_process=False)
    assert len(warnings) == 1
    w = warnings[0]
    assert w.startswith("reward 't_det_unseeded' is not deterministic: 8 of 8 samples scored differently "
                        "when scored twice (e.g. prompt 'What is 2+2?', completion '4': 0.")
    assert w.endswith("seed its randomness or fix the reward")


def test_deterministic_builtins_pass_and_the_checkers_are_restarted():
    specs = [{"name": "math_accuracy", "args": {"timeout_s": 10.0}}, {"name": "exact_match"},
             {"name": "numeric_match"}, {"name": "boxed_format"}, {"name": "soft_overlong"},
             {"name": "length_group", "args": {"verifier": "exact_match"}}]
    rs = RewardSet.from_specs(specs)
    pool = M._workers()
    prompts, completions, columns = probe_batch(ROWS)
    rs.score(prompts, completions, columns)                   # the math checkers are up
    before = pool.pids()
    assert before
    # without the fresh-process pass the checkers are kept
    assert check_rows(rs, ROWS, fresh_process=False) == []
    assert sorted(pool.pids()) == sorted(before)
    assert check_rows(rs, ROWS) == []                          # and with it: new checker processes
    after = pool.pids()
    assert after and not set(after) & set(before)
    assert all(_gone(pid) for pid in before)                   # the old ones were killed and reaped


def test_the_fresh_process_pass_scores_in_new_processes(temp_rewards, tmp_path):
    """A reward whose score is its checker's pid: equal twice in one process, different after
    the restart, which shows the third pass ran in a new process."""
    script = tmp_path / "pid_checker.py"
    script.write_text(PID_CHECKER)
    pool = WorkerPool(str(script), size=1)
    try:
        temp_rewards("t_det_checker_pid",
                     lambda prompts, completions, **c: [float(pool.call({}, 10.0)["pid"]) for _ in completions])
        rs = RewardSet.from_specs([{"name": "t_det_checker_pid"}])
        batch = probe_batch(ROWS, n=4)
        assert check_determinism(rs, *batch, fresh_process=False) == []
        old = pool.pids()
        warnings = check_determinism(rs, *batch)
        assert len(warnings) == 1
        assert warnings[0].startswith("reward 't_det_checker_pid' is not deterministic: 4 of 4 samples scored "
                                      "differently when scored again in fresh checker processes (e.g. prompt ")
        assert f": {float(old[0])!r} vs {float(pool.pids()[0])!r});" in warnings[0]
        assert warnings[0].endswith("its score depends on state kept in the checker process; fix the reward")
        assert _gone(old[0])
    finally:
        pool.close()


def test_a_reward_failing_on_one_call_only_is_reported(temp_rewards, caplog):
    calls = []

    def second_call_raises(prompts, completions, **c):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return [1.0] * len(completions)

    def always_raises(prompts, completions, **c):
        raise RuntimeError("always")

    temp_rewards("t_det_second_call", second_call_raises)
    temp_rewards("t_det_always", always_raises)
    rs = RewardSet.from_specs([{"name": "t_det_always"}, {"name": "t_det_second_call"}])
    with caplog.at_level(logging.ERROR, logger="grpokit.rewards"):
        warnings = check_determinism(rs, *probe_batch(ROWS), fresh_process=False)
    assert warnings == [
        "reward 't_det_second_call' is not deterministic: it failed the second time but not the first time "
        "(its error is logged on logger grpokit.rewards), so 8 of 8 samples scored differently when scored "
        "twice (e.g. prompt 'What is 2+2?', completion '4': 1.0 vs None); fix the reward"]
    assert "boom" in caplog.text and "always" in caplog.text  # contained and logged, not raised
    assert rs.error_counts == {"t_det_always": 0, "t_det_second_call": 0}  # the run's counters untouched


def test_the_cross_check_is_left_alone(tmp_path):
    dump = tmp_path / "disagree.jsonl"
    rs = RewardSet.from_specs([{"name": "exact_match"}],
                              crosscheck={"primary": "exact_match", "checker": "numeric_match", "fraction": 1.0,
                                          "dump_path": str(dump)})
    state = rs._rng.getstate()
    assert check_determinism(rs, *probe_batch(ROWS), fresh_process=False) == []
    assert not dump.exists() and rs.calls == 0 and rs._rng.getstate() == state


def test_no_pass_starts_after_the_budget(temp_rewards, caplog):
    temp_rewards("t_det_unseeded_budget", lambda prompts, completions, **c: [random.random() for _ in completions])
    rs = RewardSet.from_specs([{"name": "t_det_unseeded_budget"}])
    with caplog.at_level(logging.WARNING, logger="grpokit.rewards"):
        assert check_determinism(rs, *probe_batch(ROWS), budget_s=0.0) == []
    assert "the second scoring skipped" in caplog.text


def test_probe_batch_lays_out_columns_like_the_trainer():
    rows = ROWS + [{"prompt": "Write f", "tests": "assert f() == 1"}, {"prompt": "Zero?", "answer": "0"}]
    prompts, completions, columns = probe_batch(rows, n=100)
    assert prompts[:5] == ["What is 2+2?"] * 4 + ["Half of one?"]
    assert completions[:4] == ["4", "The answer is $\\boxed{4}$.", "The answer is $\\boxed{0}$.", ""]
    assert completions[8] == "```python\nprint(0)\n```"
    assert completions[12:] == ["0", "The answer is $\\boxed{0}$.", "The answer is $\\boxed{1}$.", ""]
    n = len(completions)
    assert n == 16
    assert sorted(columns) == ["answer", "completion_length", "finish_reason", "group_id", "level",
                               "max_new_tokens", "tests"]
    assert columns["answer"][8] is None and columns["tests"][8] == "assert f() == 1" and columns["level"][4] == 2
    assert columns["group_id"] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert columns["completion_length"] == [len(c) for c in completions]       # characters
    assert columns["finish_reason"] == ["eos"] * n
    assert columns["max_new_tokens"] == [max(len(c) for c in completions)] * n
    assert all(len(v) == n for v in columns.values())
    # the trainer's prompt text and token counts, and the size bound
    p, c, cols = probe_batch(rows, n=6, prompt_text=lambda pr: f"<{pr if isinstance(pr, str) else 'chat'}>",
                             max_new_tokens=64, completion_length=lambda s: len(s.split()))
    assert p == ["<What is 2+2?>"] * 4 + ["<chat>"] * 2 and len(c) == 6
    assert cols["completion_length"][:2] == [1, 4] and cols["max_new_tokens"] == [64] * 6
    RewardSet.from_specs([{"name": "exact_match"}]).score(p, c, cols)     # a valid batch for score
    with pytest.raises(ValueError):
        probe_batch([])


def test_scores_compare_exactly_up_to_rounding():
    assert same(None, None) and same(float("nan"), float("nan")) and same(0.5, 0.5)
    assert same(0.1 + 0.2, 0.3) and same(1e6, 1e6 * (1 + 1e-15))
    assert not same(None, 0.0) and not same(0.0, None) and not same(float("nan"), 0.0)
    assert not same(0.0, 1e-9) and not same(1.0, 1.0 + 1e-10)


def test_restart_retires_a_busy_checker_when_its_call_returns(tmp_path):
    slow = tmp_path / "slow_checker.py"
    slow.write_text("import json, os, sys, time\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
                    "    req = json.loads(line)\n    time.sleep(0.5)\n"
                    "    print(json.dumps({'id': req['id'], 'pid': os.getpid()}), flush=True)\n")
    pool = WorkerPool(str(slow), size=1)
    try:
        first = pool.call({}, 5.0)["pid"]
        out = []
        t = threading.Thread(target=lambda: out.append(pool.call({}, 5.0)))
        t.start()
        time.sleep(0.2)
        assert pool.restart() == 1                      # the one worker, busy
        t.join(5)
        assert out[0]["pid"] == first                   # its call finished in the old process
        assert pool.idle == [] and pool.count == 0 and _gone(first)
        assert pool.call({}, 5.0)["pid"] != first       # the next call starts a fresh one
    finally:
        pool.close()
    assert pool.restart() == 0                          # a closed pool stays closed
