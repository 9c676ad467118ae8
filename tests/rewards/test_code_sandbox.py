"""grpokit.rewards.code: semantics of run_tests, the reward, and the hostile-program suite.

Every hostile program is written so that a *successful* attack would make its tests pass; being
contained means: no pass, bounded time, no side effect outside the sandbox, no surviving process,
and this (the trainer's) process unharmed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid

import pytest

from grpokit.rewards import REGISTRY, extract_code, run_tests, run_tests_batch
from grpokit.rewards import _sandbox
from tests.rewards.clocks import thread_cpu, under_load


def _sandbox_leftovers(marker: str | None = None, owner: int | None = None) -> list[str]:
    """Live processes of sandboxes started by `owner` (default: this process), found by the
    token every sandboxed environment carries, or any process whose command line has `marker`.
    Only our own runs count, so a concurrent test run on the same machine does not interfere."""
    time.sleep(0.05)
    tag = f"GRPOKIT_SANDBOX={owner or os.getpid()}-".encode()
    left = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(tag) for e in env) or (marker and marker in cmd):
            left.append(f"{name}: {cmd[:120]}")
    return left


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    assert _sandbox_leftovers() == []


@pytest.fixture(scope="module")
def iso():
    return _sandbox.isolation()


# --------------------------------------------------------------------------- semantics

ADD = "def add(a, b):\n    return a + b\n"


def test_all_pass_partial_and_fail():
    r = run_tests(ADD, "assert add(1, 2) == 3\nassert add(2, 2) == 4\n", timeout_s=2)
    assert (r.status, r.passed, r.total) == ("ok", 2, 2)
    r = run_tests(ADD, "assert add(1, 2) == 3\nassert add(2, 2) == 5\nassert add(0, 0) == 0\n", timeout_s=2)
    assert (r.status, r.passed, r.total) == ("failed", 2, 3)
    assert r.fraction == pytest.approx(2 / 3)


def test_setup_statements_and_humaneval_check_style():
    tests = "import math\ndef check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\nEXPECTED = 7\ncheck(add)\nassert add(3, 4) == EXPECTED\n"
    r = run_tests(ADD, tests, timeout_s=2)
    assert (r.status, r.passed, r.total) == ("ok", 2, 2)  # check(add) and the assert; setup is not a test


def test_program_errors_are_crashes():
    assert run_tests("def add(a, b:\n", "assert add(1, 1) == 2", timeout_s=2).status == "crashed"
    assert run_tests("raise RuntimeError('boom')", "assert True", timeout_s=2).status == "crashed"
    r = run_tests("import sys\nsys.exit(0)", "assert True", timeout_s=2)  # exits before the tests run
    assert (r.status, r.passed) == ("crashed", 0)
    r = run_tests("import os\nos._exit(0)", "assert True", timeout_s=2)
    assert (r.status, r.passed) == ("crashed", 0)


def test_main_block_does_not_run_in_assert_mode():
    prog = ADD + "if __name__ == '__main__':\n    print(add(int(input()), 1))\n"
    assert run_tests(prog, "assert add(1, 1) == 2", timeout_s=2).status == "ok"


def test_bad_tests_are_errors_not_crashes():
    r = run_tests(ADD, "assert add(1, 1) ==", timeout_s=2)
    assert r.status == "error" and r.total == 0


def test_stdin_stdout_cases():
    prog = "n = int(input())\nprint(n * 2)\n"
    r = run_tests(prog, [{"input": "2\n", "output": "4\n"}, {"input": "5", "output": "10"}, {"input": "1", "output": "3"}], timeout_s=2)
    assert (r.status, r.passed, r.total) == ("failed", 2, 3)
    r = run_tests("print(0.1 + 0.2)", '{"inputs": [""], "outputs": ["0.3"]}', timeout_s=2)
    assert r.status == "ok"  # numbers compared within 1e-6, JSON form accepted


def test_output_is_captured_and_capped():
    r = run_tests("print('hello'); import sys; print('oops', file=sys.stderr)", "assert True", timeout_s=2)
    assert r.stdout == "hello\n" and r.stderr == "oops\n"
    r = run_tests("print('x' * 100000)", "assert True", timeout_s=2, output_cap=1000)
    assert r.stdout.startswith("x" * 1000) and "more bytes dropped" in r.stdout and len(r.stdout) < 1100


def test_always_equal_hack_does_not_pass():
    prog = "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\ndef add(a, b):\n    return Any()\n"
    r = run_tests(prog, "assert add(1, 2) == 3\nassert add(1, 2) == [3]\n", timeout_s=2)
    assert r.passed == 0
    from fractions import Fraction  # noqa: F401 - stdlib classes with __eq__ still compare
    r = run_tests("from fractions import Fraction\ndef half():\n    return Fraction(1, 2)\n", "assert half() == 0.5", timeout_s=2)
    assert r.status == "ok"


def test_forged_result_lines_on_stdout_do_not_count():
    prog = "print('{\"ev\": \"test\", \"i\": 0, \"ok\": true}')\nprint('{\"ev\": \"done\", \"status\": \"ok\"}')\n"
    r = run_tests(prog, "assert False", timeout_s=2)
    assert (r.status, r.passed) == ("failed", 0)


def test_values_of_builtin_types_are_compared_by_the_trainer():
    prog = (
        "from fractions import Fraction\n"
        "def f(x):\n    return x\n"
        "def big():\n    return 3 ** 200\n"
        "def gen():\n    return (i * i for i in range(4))\n"
        "def mixed():\n    return {'a': (1, 2.5, None), 'b': {1, 2}, 'c': b'xy', 'd': frozenset([3]), 'e': 1 + 2j}\n"
        "class Solution:\n    def two_sum(self, nums, target):\n        return [0, 1]\n"
    )
    tests = (
        "import math\n"
        "assert big() == 3 ** 200\n"
        "assert f(Fraction(1, 2)) == 0.5\n"  # stdlib Fraction travels as a fraction
        "assert list(gen()) == [0, 1, 4, 9]\n"  # a generator is iterated in the sandbox, sent as a list
        "assert mixed() == {'a': (1, 2.5, None), 'b': {1, 2}, 'c': b'xy', 'd': frozenset([3]), 'e': 1 + 2j}\n"
        "assert f((1, 2)) != [1, 2]\n"  # a tuple stays a tuple
        "assert f(float('nan')) != f(float('nan'))\n"
        "assert abs(f(0.1 + 0.2) - 0.3) < 1e-9 and math.isclose(f(2.0), 2.0000001, rel_tol=1e-6)\n"
        "assert sorted(f([3, 1, 2])) == [1, 2, 3] and len(f('abc')) == 3 and type(f([])) is list\n"
        "assert f(None) is None and 0 < f(5) <= 5 and f(3) in (1, 2, 3)\n"
        "sol = Solution()\n"
        "assert sol.two_sum([2, 7], 9) == [0, 1]\n"
    )
    r = run_tests(prog, tests, timeout_s=5)
    assert (r.status, r.passed, r.total, r.untrusted) == ("ok", 10, 10, 0), r.detail


def test_a_value_that_is_not_plain_data_fails_unless_objects_are_judged_in_the_sandbox():
    prog, tests = "class P:\n    pass\ndef f():\n    return P()\n", "assert f() == 1\nassert f() is not None\n"
    r = run_tests(prog, tests, timeout_s=2)
    assert (r.status, r.passed, r.untrusted, r.untrusted_passed, r.trusted_total) == ("failed", 0, 0, 0, 2)
    assert "test 1" in r.detail and "not plain data" in r.detail and "objects_in_sandbox" in r.detail
    r = run_tests(prog, tests, timeout_s=2, objects_in_sandbox=True)
    assert (r.status, r.passed, r.untrusted, r.untrusted_passed, r.trusted_total) == ("failed", 1, 2, 1, 2)


def test_humaneval_check_is_inlined_and_its_expected_values_stay_in_the_trainer():
    from grpokit.rewards._testplan import plan_tests

    tests = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-6\ncheck(add)\n"
    plan = plan_tests(tests)
    assert plan.steps == (("eval", 0, ("add(2, 3)", "add(0.5, 0.25)")),)  # no `def check`: no 5, no 0.75
    assert (plan.total, plan.untrusted) == (1, 0)
    assert run_tests(ADD, tests, timeout_s=2).status == "ok"
    assert run_tests("def add(a, b):\n    return a * b\n", tests, timeout_s=2).status == "failed"


def test_untrusted_tests_are_counted_and_trusted_only_leaves_them_out():
    # a loop inside check() cannot be split: its verdict comes from the sandbox (forgeable)
    tests = "def check(f):\n    for i in range(3):\n        assert f(i, 1) == i + 1\ncheck(add)\nassert add(1, 1) == 2\n"
    r = run_tests(ADD, tests, timeout_s=2)
    assert (r.status, r.passed, r.total, r.untrusted, r.untrusted_passed, r.trusted_total) == ("ok", 2, 2, 1, 1, 1)
    fn = REGISTRY["code_tests"]
    comp = "```python\n" + ADD + "```"
    assert fn(["p"], [comp], timeout_s=2, tests=[tests]) == [1.0]
    assert fn(["p"], [comp], timeout_s=2, trusted_only=True, tests=[tests]) == [1.0]
    assert fn(["p"], [comp], timeout_s=2, trusted_only=True, all_or_nothing=True, tests=[tests]) == [1.0]
    # a forged pass of the untrusted test does not help a program that fails the trusted one
    wrong = "```python\ndef add(a, b):\n    return a + b if a != 1 else 0\n```"
    assert fn(["p"], [wrong], timeout_s=2, trusted_only=True, tests=[tests]) == [0.0]


_OBJECTS = (
    "class P:\n"
    "    def __init__(self, x):\n        self.x = x\n"
    "    def __eq__(self, other):\n        return isinstance(other, P) and other.x == self.x\n"
    "    def __hash__(self):\n        return hash(self.x)\n"
    "    def __repr__(self):\n        return f'P({self.x})'\n"
    "    def __len__(self):\n        return self.x\n"
    "def mk(x):\n    return P(x)\n"
    "def keys():\n    return {1: 'a', 2: 'b'}.keys()\n"
    "def total(xs):\n    return sum(xs)\n"
)
_OBJECT_TESTS = (
    'assert str(mk(1)) == "P(1)"\nassert mk(1) == P(1)\nassert len(mk(3)) == 3\nassert isinstance(mk(1), P)\n'
    "assert 1 in keys()\nassert mk(2).x == 2\nassert total([1, 2]) == 3\n"
)


def test_programs_returning_their_own_objects_are_judged_in_the_sandbox_untrusted():
    # values that cannot travel as plain data: by default their tests fail (a hostile program
    # could claim "not plain data" for every test); opted in, a second run has the sandbox run
    # those asserts
    r = run_tests(_OBJECTS, _OBJECT_TESTS, timeout_s=3)
    assert (r.status, r.passed, r.untrusted) == ("failed", 2, 0), r.detail
    r = run_tests(_OBJECTS, _OBJECT_TESTS, timeout_s=3, objects_in_sandbox=True)
    assert (r.status, r.passed, r.total, r.untrusted, r.untrusted_passed, r.trusted_total) == ("ok", 7, 7, 5, 5, 7), r.detail
    wrong = _OBJECTS.replace("return P(x)", "return P(x + 1)")
    r = run_tests(wrong, _OBJECT_TESTS, timeout_s=3, objects_in_sandbox=True)
    assert (r.status, r.passed, r.untrusted_passed) == ("failed", 3, 2) and "test 1: failed in the sandbox" in r.detail
    fn = REGISTRY["code_tests"]
    comp = "```python\n" + _OBJECTS + "```"
    assert fn(["p"], [comp], timeout_s=3, tests=[_OBJECT_TESTS]) == [pytest.approx(2 / 7)]
    assert fn(["p"], [comp], timeout_s=3, objects_in_sandbox=True, tests=[_OBJECT_TESTS]) == [1.0]
    assert fn(["p"], [comp], timeout_s=3, objects_in_sandbox=True, trusted_only=True,
              tests=[_OBJECT_TESTS]) == [pytest.approx(2 / 7)]
    # linked lists and trees: the program's node classes, compared with nodes the test builds
    nodes = (
        "from dataclasses import dataclass\n"
        "@dataclass\nclass TreeNode:\n    val: int\n    left: 'TreeNode' = None\n    right: 'TreeNode' = None\n"
        "def invert(t):\n    return t and TreeNode(t.val, invert(t.right), invert(t.left))\n"
        "class ListNode:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
        "def reverse(head, prev=None):\n    return reverse(head.next, ListNode(head.val, prev)) if head else prev\n"
    )
    tests = (
        "assert invert(TreeNode(1, TreeNode(2), TreeNode(3))) == TreeNode(1, TreeNode(3), TreeNode(2))\n"
        "assert invert(None) is None\n"
        "head = reverse(ListNode(1, ListNode(2)))\n"
        "assert head.val == 2 and head.next.val == 1\nassert isinstance(head, ListNode)\n"
    )
    r = run_tests(nodes, tests, timeout_s=3, objects_in_sandbox=True)
    assert (r.status, r.passed, r.total, r.untrusted) == ("ok", 4, 4, 2), r.detail


def test_objects_that_are_not_plain_data_never_crash_the_harness():
    prog = (
        "import sys\n"
        "class Meta(type):\n"
        "    @property\n    def __module__(cls):\n        raise KeyboardInterrupt\n"
        "class Bad(metaclass=Meta):\n"
        "    def __eq__(self, other):\n        raise SystemExit(0)\n"
        "    def __hash__(self):\n        raise KeyboardInterrupt\n"
        "    def __repr__(self):\n        raise RecursionError\n"
        "    def __len__(self):\n        raise MemoryError\n"
        "class Plain:\n    pass\n"
        "loop = []\nloop.append(loop)\n"
        "values = {'bad': Bad(), 'plain': Plain(), 'keys': {1: 2}.keys(), 'items': {1: 2}.items(),\n"
        "          'gen': (i for i in range(3)), 'module': sys, 'type': Plain, 'loop': loop,\n"
        "          'in_dict': {Plain(): 1}, 'in_list': [1, Plain()]}\n"
        "def f(name):\n    return values[name]\n"
        + ADD
    )
    names = ["bad", "plain", "keys", "items", "gen", "module", "type", "loop", "in_dict", "in_list"]
    tests = "".join(f"assert f({n!r}) == f({n!r})\nassert len(f({n!r})) == 1\n" for n in names)
    tests += "assert add(1, 2) == 3\n"
    r = run_tests(prog, tests, timeout_s=5, objects_in_sandbox=True)
    assert r.status == "failed" and r.total == 2 * len(names) + 1, (r.status, r.detail, r.stderr[-500:])
    # every test got a verdict, the last one included: all but the recursive list (too deep to
    # send) went to the second run, where `==` holds for all but `bad`, whose __eq__ exits, and
    # `len` holds for the dict views and the dict
    assert (r.passed, r.untrusted, r.untrusted_passed) == (12, 18, 11), r.detail


def test_setup_calls_are_not_tests_and_trusted_only_can_reach_one():
    tests = "import random\nrandom.seed(0)\nprint('setup')\nassert add(1, 2) == 3\nassert add(2, 2) == 4\n"
    r = run_tests(ADD, tests, timeout_s=2)
    assert (r.status, r.passed, r.total, r.untrusted, r.trusted_total) == ("ok", 2, 2, 0, 2)
    fn = REGISTRY["code_tests"]
    comp = "```python\n" + ADD + "```"
    assert fn(["p"], [comp], timeout_s=2, trusted_only=True, tests=[tests]) == [1.0]
    assert fn(["p"], [comp], timeout_s=2, trusted_only=True, all_or_nothing=True, tests=[tests]) == [1.0]


def test_trusted_only_cannot_score_a_test_set_without_trusted_tests():
    tests = "def check(f):\n    for i in range(3):\n        assert f(i, 1) == i + 1\ncheck(add)\n"
    fn = REGISTRY["code_tests"]
    comp = "```python\n" + ADD + "```"
    assert fn(["p"], [comp], timeout_s=2, tests=[tests]) == [1.0]
    assert fn(["p"], [comp], timeout_s=2, trusted_only=True, tests=[tests]) == [None]  # no signal, not a flat 0


def test_plans_are_cached_immutable_and_quick_to_build():
    from grpokit.rewards._testplan import plan_tests

    tests = "assert add(1, 2) == 3\n"
    plan = plan_tests(tests)
    assert plan_tests(tests) is plan and isinstance(plan.steps, tuple) and isinstance(plan.checks, tuple)
    redo = plan.redo_steps([0])
    assert redo == [["run", 0, "assert add(1, 2) == 3"]] and plan.steps == (("eval", 0, ("add(1, 2)",)),)
    for depth in (18, 60):  # the "depends on the program" flag was recomputed at every level: 2**depth
        nested = "assert " + "abs(" * depth + "f(1)" + ")" * depth + f" == {depth}\n"
        cpu0 = thread_cpu()
        plan = plan_tests(nested)
        assert thread_cpu() - cpu0 < 0.5 and plan.untrusted == 0


@pytest.mark.parametrize("tests", [
    "assert f(1) == " + "+".join(["1"] * 500),
    "assert f(" + "+".join(["1"] * 500) + ") == 500",
    "def check(g):\n    assert g(1) == " + "+".join(["1"] * 500) + "\ncheck(f)",
], ids=["expected", "argument", "check"])
def test_tests_too_deep_for_the_planner_run_in_the_sandbox_untrusted(tests):
    from grpokit.rewards._testplan import plan_tests

    assert plan_tests(tests).untrusted == 1  # no RecursionError
    r = run_tests("def f(x):\n    return 500\n", tests, timeout_s=3)
    assert (r.status, r.passed, r.total, r.untrusted) == ("ok", 1, 1, 1), r.detail


_CHECK_TEXT = "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)\nassert add(0, 5) == 5\n"


@pytest.mark.parametrize("tests,trusted", [
    (_CHECK_TEXT, [True, True]),
    (_CHECK_TEXT + "alias = check\n", [False, True]),  # check()'s definition is sent, 3 included
    ("def helper():\n    for _ in range(1):\n        assert add(0,5)==5\n" + _CHECK_TEXT, [True, False]),
    ("NOTE = 'assert add(0, 5) == 5'\n" + _CHECK_TEXT, [True, False]),  # the text itself is sent
], ids=["not-sent", "alias", "helper", "string"])
def test_a_test_whose_expected_values_are_sent_is_untrusted(tests, trusted):
    from grpokit.rewards._testplan import plan_tests

    plan = plan_tests(tests)
    assert [c.trusted for c in plan.checks] == trusted
    sent = repr(plan.steps)
    assert ("== 3" in sent) == (not trusted[0]) and ("==5" in sent or "== 5" in sent) == (not trusted[1])


def test_each_stdin_stdout_case_runs_in_a_fresh_process():
    prog = "import builtins\nbuiltins.seen = getattr(builtins, 'seen', 0) + 1\nprint(builtins.seen)\n"
    r = run_tests(prog, [{"input": "", "output": "1"}] * 3, timeout_s=2)
    assert (r.status, r.passed) == ("ok", 3)  # no state carried over from the previous case
    r = run_tests("import sys\nprint(sys.stdin.read().upper())\nsys.exit(0)\n", [{"input": "abc\ndef", "output": "ABC DEF"}], timeout_s=2)
    assert r.status == "ok"
    r = run_tests("print('partial')\nraise SystemExit(3)\n", [{"input": "", "output": "partial"}], timeout_s=2)
    assert (r.status, r.passed) == ("failed", 0)  # a non-zero exit fails even with the right output
    r = run_tests("print('x' * 5000)", [{"input": "", "output": "x" * 5000}], timeout_s=2, output_cap=1000)
    assert (r.status, r.passed) == ("failed", 0)  # more than output_cap: over the limit


def test_extract_code_takes_the_last_python_block():
    text = "Plan:\n```text\nnot code\n```\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"  # untagged fallback
    assert extract_code("```python\nz = 1\n") is None  # unclosed (truncated) fence
    assert extract_code("no code") is None


def test_code_tests_reward():
    fn = REGISTRY["code_tests"]
    comps = ["```python\n" + ADD + "```", "```python\ndef add(a, b):\n    return a - b\n```", "no code", "```python\n" + ADD + "```"]
    tests = ["assert add(1, 1) == 2\nassert add(0, 3) == 3"] * 3 + [None]
    cols = dict(tests=tests, answer=[None] * 4, completion_length=[9] * 4, finish_reason=["eos"] * 4, group_id=[0] * 4)
    assert fn(["p"] * 4, comps, timeout_s=2, **cols) == [1.0, 0.0, 0.0, None]
    partial = "```python\ndef add(a, b):\n    return 2 if a == 1 else a - b\n```"
    assert fn(["p"], [partial], timeout_s=2, tests=[tests[0]]) == [0.5]
    assert fn(["p"], [partial], timeout_s=2, all_or_nothing=True, tests=[tests[0]]) == [0.0]
    assert fn(["p"], ["```python\nx = 1\n```"], timeout_s=2, tests=["assert ("]) == [None]  # broken tests


def test_batch_runs_in_parallel_and_a_hung_program_does_not_block():
    progs = ["while True: pass"] * 2 + [ADD] * 6
    tests = ["assert True"] * 2 + [f"assert add({i}, 1) == {i + 1}" for i in range(6)]
    t0 = time.monotonic()
    res = run_tests_batch(progs, tests, timeout_s=1.0)
    took = time.monotonic() - t0
    assert [r.status for r in res] == ["timeout"] * 2 + ["ok"] * 6
    assert took < under_load(8.0), took  # the two hung ones overlap (about 1.5 s); a blocked batch never ends


def test_batch_deduplicates_identical_jobs():
    res = run_tests_batch([ADD] * 5, ["assert add(1, 1) == 2"] * 5, timeout_s=2)
    assert all(r is res[0] for r in res)


# --------------------------------------------------------------------------- hostile suite


def _assert_contained(r, t0, limit_s):
    """No pass, and killed in time: `limit_s` is the wall-clock bound on a quiet machine (a real
    deadline, so wall time, with room for a loaded one)."""
    took = time.monotonic() - t0
    assert r.status != "ok" and r.passed == 0, (r.status, r.passed, r.detail, r.stdout[-300:], r.stderr[-300:])
    assert took < under_load(limit_s), took


def test_hostile_infinite_loop():
    t0 = time.monotonic()
    r = run_tests("while True:\n    pass\n", "assert True", timeout_s=1.0)
    _assert_contained(r, t0, 5.0)
    assert r.status == "timeout"


def test_hostile_infinite_loop_in_the_tests_and_sleep():
    t0 = time.monotonic()
    r = run_tests("import time\ndef f():\n    time.sleep(60)\n", "f()\nassert True", timeout_s=1.0)
    _assert_contained(r, t0, 5.0)
    assert r.status == "timeout"


def test_hostile_memory_bomb():
    t0 = time.monotonic()
    # the limit is hit in well under a second; the generous wall clock keeps a loaded machine
    # from turning this into a timeout, so the status really shows the memory limit at work
    r = run_tests("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n", "assert len(blocks) > 100", timeout_s=8.0, memory_mb=256)
    _assert_contained(r, t0, 10.0)
    assert r.status == "memory"


def test_hostile_fork_bomb(iso):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    prog = f"# {marker}\nimport os\nn = 0\nwhile True:\n    try:\n        os.fork()\n        n += 1\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    r = run_tests(prog, "assert n > 10000", timeout_s=1.0, nproc=16)
    _assert_contained(r, t0, 4.0)
    assert _sandbox_leftovers(marker) == []


def test_hostile_disk_filling(iso):
    prog = (
        "written = 0\nchunk = b'0' * 2**20\n"
        "try:\n    with open('big.bin', 'wb') as f:\n        while written < 2**30:\n            f.write(chunk)\n            written += len(chunk)\n"
        "except OSError:\n    pass\n"
        "files = 0\ntry:\n    while files < 100000:\n        open(f'f{files}', 'w').write('x' * 1000)\n        files += 1\n"
        "except OSError:\n    pass\n"
    )
    t0 = time.monotonic()
    r = run_tests(prog, "assert written >= 2**30\nassert files >= 100000", timeout_s=3.0, file_mb=4)
    _assert_contained(r, t0, 6.0)


def test_hostile_writes_outside_the_sandbox(iso, tmp_path):
    target = tmp_path / "open-dir"
    target.mkdir()
    os.chmod(tmp_path, 0o777)
    os.chmod(target, 0o777)  # world-writable: DAC alone does not stop this one
    tag = uuid.uuid4().hex
    outside = [target / "pwned", f"/var/tmp/grpokit-pwned-{tag}", f"/dev/shm/grpokit-pwned-{tag}",
               os.path.join(os.path.dirname(_sandbox.LAUNCHER), f"pwned-{tag}.py"), os.path.expanduser(f"~/pwned-{tag}")]
    host_tmp = f"/tmp/grpokit-pwned-{tag}"  # inside the sandbox /tmp is its own tmpfs: writable, never the host's
    prog = "import os\nhits = 0\n" + "".join(
        f"try:\n    open({str(v)!r}, 'w').write('pwned')\n    hits += 1\nexcept OSError:\n    pass\n" for v in outside
    ) + f"try:\n    open({host_tmp!r}, 'w').write('pwned')\nexcept OSError:\n    pass\n"
    r = run_tests(prog, "assert hits > 0", timeout_s=2.0)
    for v in outside + [host_tmp]:
        assert not os.path.exists(v), v
    if not iso.mountns:
        pytest.skip("no mount namespace: world-writable paths are not protected here")
    assert r.passed == 0, r


@pytest.mark.parametrize("mode", ["namespaces+uid", "namespaces"])
def test_hostile_remounts_the_filesystem_read_write(weak_mode, mode):
    # In "namespaces" the program is root inside its namespaces (a non-root trainer's default,
    # a root trainer's fallback): only dropping every capability keeps it from undoing the
    # read-only mounts.
    if mode == "namespaces+uid" and os.geteuid() != 0:
        pytest.skip("the sandbox uid needs a root trainer")
    weak_mode(mode)
    if run_tests(ADD, "assert add(1, 1) == 2", timeout_s=5).status != "ok":
        pytest.skip(f"mode {mode} is not available on this machine")
    target = f"/var/tmp/grpokit-remount-{uuid.uuid4().hex}"
    prog = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for flags in (32 | 4096, 32):  # MS_REMOUNT | MS_BIND, then MS_REMOUNT: both without MS_RDONLY\n"
        "    libc.mount(None, b'/', None, ctypes.c_ulong(flags), None)\n"
        "    libc.mount(None, b'/var/tmp', None, ctypes.c_ulong(flags), None)\n"
        "caps = int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16)\n"
        f"try:\n    open({target!r}, 'w').write('pwned')\n    wrote = True\nexcept OSError:\n    wrote = False\n"
    )
    r = run_tests(prog, "assert wrote\nassert caps != 0", timeout_s=3.0)
    assert r.passed == 0, r
    assert not os.path.exists(target)


def test_hostile_reads_the_trainers_home(iso, monkeypatch):
    import shutil
    import tempfile

    home = tempfile.mkdtemp(dir="/var/tmp", prefix="grpokit-home-")  # outside /tmp, which is replaced anyway
    try:
        os.chmod(home, 0o755)
        secret = uuid.uuid4().hex
        os.makedirs(os.path.join(home, ".cache"))
        with open(os.path.join(home, ".cache", "token"), "w") as f:
            f.write(secret)
        os.chmod(os.path.join(home, ".cache", "token"), 0o644)  # world-readable: only hiding stops it
        monkeypatch.setenv("HOME", home)
        prog = f"try:\n    leaked = open({os.path.join(home, '.cache', 'token')!r}).read()\nexcept OSError:\n    leaked = ''\nprint(leaked)\n"
        r = run_tests(prog, "assert leaked", timeout_s=2.0)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if not iso.mountns:
        pytest.skip("no mount namespace: the home directory is not hidden here")
    assert r.passed == 0 and secret not in r.stdout


def test_hostile_reads_a_parent_environment_secret(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("GRPOKIT_TEST_SECRET", secret)
    prog = (
        "import os\nfound = os.environ.get('GRPOKIT_TEST_SECRET', '')\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            data = open(f'/proc/{pid}/environ', 'rb').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        for item in data.split(b'\\0'):\n"
        "            if item.startswith(b'GRPOKIT_TEST_SECRET='):\n"
        "                found = item.split(b'=', 1)[1].decode()\n"
        "print(found)\n"
    )
    r = run_tests(prog, "assert found", timeout_s=2.0)
    assert r.passed == 0 and secret not in r.stdout and secret not in r.stderr


def test_hostile_network_connection(iso):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    got: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                got.append(conn.recv(100) or b"<connected>")

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'exfiltrated')\nsent = True\n"
    try:
        r = run_tests(prog, "assert sent", timeout_s=2.0)
    finally:
        time.sleep(0.3)
        stop.set()
        th.join()
        srv.close()
    if not iso.netns:
        pytest.skip("no network namespace on this machine: loopback is reachable")
    assert r.passed == 0 and got == [], (r, got)


def test_hostile_kills_its_parent_and_signals_the_trainer():
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    try:
        # SIGUSR1 to the trainer (recorded by our handler instead of killing pytest if it got
        # through), SIGKILL to its own parent, its process group and pid 1.
        prog = (
            "import os, signal\ntrainer_hit = False\n"
            f"try:\n    os.kill({os.getpid()}, signal.SIGUSR1)\n    trainer_hit = True\nexcept OSError:\n    pass\n"
            "for pid in (os.getppid(), 1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
            "try:\n    os.killpg(0, signal.SIGKILL)\nexcept OSError:\n    pass\n"
        )
        r = run_tests(prog, "assert trainer_hit", timeout_s=2.0)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert r.passed == 0, r
    assert hits == [], "the sandboxed program could signal the trainer"
    # still healthy: the next sandboxed run works
    assert run_tests(ADD, "assert add(1, 1) == 2", timeout_s=2.0).status == "ok"


def test_hostile_floods_stdout():
    t0 = time.monotonic()
    r = run_tests("import sys\nwhile True:\n    sys.stdout.write('A' * 65536)\n", "assert True", timeout_s=2.0, output_cap=4096)
    _assert_contained(r, t0, 4.0)
    assert len(r.stdout) < 4096 + 100


def test_hostile_leaves_a_detached_background_process():
    marker = f"daemon-{uuid.uuid4().hex}"
    prog = (
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True,\n"
        "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r} + '-2'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "survivor = p.pid\n"
    )
    r = run_tests(prog, "assert survivor > 0\nassert False", timeout_s=3.0)
    assert r.status in ("failed", "crashed", "timeout") and r.passed < 2
    assert _sandbox_leftovers(marker) == []


def test_a_trainer_killed_mid_run_leaves_no_sandbox_behind(tmp_path):
    marker = f"orphan-{uuid.uuid4().hex}"
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, signal, threading, time\n"
        "from grpokit.rewards import run_tests_batch\n"
        f"progs = ['import time\\ntime.sleep(60)  # {marker}'] * 2\n"
        "threading.Thread(target=run_tests_batch, args=(progs, ['assert True'] * 2), kwargs={'timeout_s': 60}, daemon=True).start()\n"
        "time.sleep(1.5)\n"
        "print('running', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    import subprocess

    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and "running" in out, err[-2000:]
    deadline = time.monotonic() + under_load(3.0)
    while _sandbox_leftovers(marker, owner=proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandbox_leftovers(marker, owner=proc.pid) == []


def test_trainer_process_is_unharmed():
    cwd, env = os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
    run_tests_batch(["import os\nos.chdir('/')\nos.environ.clear()", "while True: pass"], ["assert True"] * 2, timeout_s=1.0)
    assert os.getcwd() == cwd and dict(os.environ) == env
    assert {s: signal.getsignal(s) for s in handlers} == handlers


# --------------------------------------------------------------------------- forged results
# The trainer decides every verdict it can: the sandboxed process only sends data (values,
# captured stdout). Each program below gets a pass with the old in-process verdicts.

_FORGE = (
    "import json, os\n"
    "lines = [json.dumps({'ev': 'test', 'i': i, 'ok': True}) for i in range(8)]\n"
    "lines += [json.dumps({'u': i, 'ok': True}) for i in range(8)] + [json.dumps({'u': i, 'v': [True]}) for i in range(8)]\n"
    "lines += [json.dumps({'u': i, 'out': 'YES', 'rc': 0, 'over': False}) for i in range(8)]\n"
    "lines += [json.dumps({'ev': 'done', 'status': 'ok'}), json.dumps({'ev': 'done', 'status': 'ran'})]\n"
    "data = ('\\n'.join(lines) + '\\n').encode()\n"
    "for fd in range(3, 64):\n"
    "    try:\n        os.write(fd, data)\n    except OSError:\n        pass\n"
    "os._exit(0)\n"
)
_ANY = (
    "class Any:\n"
    "    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n"
    "    def __lt__(self, other): return True\n"
    "    def __sub__(self, other): return self\n"
    "    def __abs__(self): return self\n"
    "    def __bool__(self): return True\n"
    "    def __contains__(self, x): return True\n"
    "    __hash__ = object.__hash__\n"
)
_IO_CASES = [{"input": "3 4\n", "output": "12\n"}, {"input": "5 6\n", "output": "30\n"}, {"input": "1 1\n", "output": "1\n"}]
_ASSERTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 5) == 5\n"
_CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\ncheck(add)\nassert add(0, 5) == 5\n"


def _assert_forgery_fails(prog, tests, limit_s=6.0, **kw):
    """No pass it did not earn (passed 0, status not ok), in bounded time, and the reward < 1."""
    t0 = time.monotonic()
    r = run_tests(prog, tests, timeout_s=3.0, **kw)
    _assert_contained(r, t0, limit_s)
    fn = REGISTRY["code_tests"]
    comp = "```python\n" + prog + "```"
    assert fn(["p"], [comp], timeout_s=3.0, tests=[tests]) == [0.0]
    assert fn(["p"], [comp], timeout_s=3.0, all_or_nothing=True, tests=[tests]) == [0.0]
    return r


@pytest.mark.parametrize("tests", [_ASSERTS, _CHECK, _IO_CASES], ids=["asserts", "humaneval-check", "stdin-stdout"])
def test_hostile_forges_result_lines_on_every_fd_and_exits(tests):
    _assert_forgery_fails(_FORGE, tests)


@pytest.mark.parametrize("tests", [_ASSERTS, _CHECK, _IO_CASES], ids=["asserts", "humaneval-check", "stdin-stdout"])
def test_hostile_forges_results_then_raises_system_exit_at_import(tests):
    _assert_forgery_fails(_FORGE.replace("os._exit(0)", "raise SystemExit(0)"), tests)


def test_hostile_system_exit_at_import():
    r = _assert_forgery_fails("raise SystemExit(0)\n", _ASSERTS)
    assert r.status == "crashed"
    _assert_forgery_fails("raise SystemExit(0)\n", _IO_CASES)  # a clean exit that prints nothing


def test_hostile_replaces_exec_eval_compile_and_print():
    prog = (
        "import builtins, json\n"
        "builtins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True\n"
        "builtins.compile = lambda *a, **k: None\nbuiltins.print = lambda *a, **k: None\n"
        "json.dumps = lambda *a, **k: '{\"u\": 0, \"ok\": true}'\n"
    )
    _assert_forgery_fails(prog, _ASSERTS)
    _assert_forgery_fails(prog, _CHECK)


def test_hostile_patches_import_and_sys_modules():
    prog = (
        "import builtins, sys, types\n"
        "fake = types.ModuleType('json')\nfake.dumps = lambda *a, **k: '{\"ev\": \"test\", \"i\": 0, \"ok\": true}'\n"
        "fake.loads = lambda *a, **k: {}\n"
        "real_import = builtins.__import__\n"
        "builtins.__import__ = lambda name, *a, **k: fake if name == 'json' else real_import(name, *a, **k)\n"
        "sys.modules['json'] = fake\nsys.modules['ast'] = fake\n"
        "def add(a, b):\n    return None\n"
    )
    _assert_forgery_fails(prog, _ASSERTS)


@pytest.mark.parametrize("tests", [
    "assert 3 == add(1, 2)",
    "assert add(1, 2) in [3]",
    "a = add(1, 2)\nb = add(2, 2)\nassert a == 3 and b == 4",
    "x = add(1, 2)\nassert not (x != 3)",
    "assert abs(add(1, 2) - 3) < 1e-6",
    "assert add(1, 2) == 3",
    "import math\nassert math.isclose(add(1, 2), 3)",
    "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)",
], ids=["reversed", "in", "and", "not-ne", "abs-tolerance", "eq", "isclose", "check"])
def test_hostile_always_equal_variants(tests):
    _assert_forgery_fails(_ANY + "def add(a, b):\n    return Any()\n", tests)


def test_hostile_always_equal_subclass_of_int():
    prog = "class Int(int):\n    def __eq__(self, other): return True\n    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(0)\n"
    _assert_forgery_fails(prog, _ASSERTS)


# Every container reachable in the sandboxed interpreter (gc, and the locals of every frame up to
# the launcher's main(), which holds its configuration), as (object, its items).
_REACHABLE = (
    "import gc, sys\n"
    "def _containers():\n"
    "    roots = gc.get_objects()\n"
    "    f = sys._getframe()\n"
    "    while f is not None:\n"
    "        roots.append(dict(f.f_locals))\n"
    "        f = f.f_back\n"
    "    for o in roots:\n"
    "        if isinstance(o, dict):\n"
    "            yield o, list(o.keys()) + list(o.values())\n"
    "        elif isinstance(o, (list, tuple, set, frozenset)):\n"
    "            yield o, list(o)\n"
)
# Answers an assert test from any string that holds its condition (`(1, 2) == 3`).
_ASSERT_LEAK = _REACHABLE + (
    "import re\n"
    "def add(a, b):\n"
    "    pattern = r'\\(%d, %d\\) == (-?\\d+)' % (a, b)\n"
    "    for _, items in _containers():\n"
    "        for v in items:\n"
    "            if isinstance(v, str) and re.search(pattern, v):\n"
    "                return int(re.search(pattern, v).group(1))\n"
)
# Answers a stdin/stdout case from any container that holds its input next to a one-token string:
# a case dict, an (input, output) pair, or an outputs list parallel to an inputs list.
_IO_LEAK = _REACHABLE + (
    "text = sys.stdin.read()\n"
    "def _answers():\n"
    "    for o, items in _containers():\n"
    "        if text in items and not isinstance(o, dict):\n"
    "            i = items.index(text)\n"
    "            yield from items[i + 1:i + 2]\n"
    "        if isinstance(o, dict):\n"
    "            values = list(o.values())\n"
    "            if text in values:\n"
    "                yield from values\n"
    "            lists = [v for v in values if isinstance(v, (list, tuple))]\n"
    "            for a in lists:\n"
    "                if text in a:\n"
    "                    yield from (b[list(a).index(text)] for b in lists if b is not a and len(b) == len(a))\n"
    "found = [v for v in _answers() if isinstance(v, str) and v != text and len(v.split()) == 1]\n"
    "print(found[0] if found else '?')\n"
)


def test_hostile_reads_expected_values_from_the_harness_memory():
    # the parent never sends them: the assert's constants, check()'s body, the expected stdout.
    # First the controls: planted where the parent would have put them, the readers find them.
    planted = "_leak = {'tests': 'assert add(1, 2) == 3; assert add(2, 2) == 4; assert add(0, 5) == 5'}\n"
    assert run_tests(planted + _ASSERT_LEAK, _ASSERTS, timeout_s=3.0).passed == 3
    cases = repr(_IO_CASES)
    for leak in (f"_leak = {cases}\n", f"_leak = [(c['input'], c['output']) for c in {cases}]\n",
                 f"_leak = {{'inputs': [c['input'] for c in {cases}], 'outputs': [c['output'] for c in {cases}]}}\n"):
        assert run_tests(leak + _IO_LEAK, _IO_CASES, timeout_s=3.0).passed == 3, leak
    _assert_forgery_fails(_ASSERT_LEAK, _ASSERTS)
    _assert_forgery_fails(_ASSERT_LEAK, _CHECK)
    _assert_forgery_fails(_IO_LEAK, _IO_CASES)


@pytest.mark.parametrize("prog,tests", [
    ("def f():\n    return {k * (2**61 - 1) for k in range(1, 3000)}\n", "assert f() == {1}"),  # one hash for all
    ("def f():\n    return {k * (2**61 - 1): 0 for k in range(1, 3000)}\n", "assert f() == {1: 0}"),
    ("def f():\n    return [k * (2**61 - 1) for k in range(1, 3000)]\n", "assert set(f()) == {1}"),
    ("from fractions import Fraction\ndef f():\n    return [Fraction(1, p) for p in range(10**6, 10**6 + 20000)]\n",
     "assert sum(f()) == 1"),  # the running sum's denominator grows at every step
    ("def f():\n    return 3 ** 100000\n", "assert f() ** 1000 == 1\nassert f() << 10**9 == 1\nassert pow(f(), f(), 7) == 1"),
    ("def f():\n    return [0] * 10**7\n", "assert len(f()) == 10**7"),  # too large to send
], ids=["set", "dict", "set-call", "fraction-sum", "powers", "huge-list"])
def test_hostile_values_that_are_expensive_for_the_trainer(prog, tests):
    # the trainer computes on values the program chose: every operation is bounded
    _assert_forgery_fails(prog, tests, limit_s=6.0)


@pytest.fixture
def no_digit_limit():
    """A trainer that lifted CPython's int/str digit limit: int(text) and str(int) are then
    quadratic, so the judge must bound them itself."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(old)


_FRACTION_TEST = "from fractions import Fraction\nassert Fraction(f(1)) == Fraction(1, 3)\n"
_DECIMAL_TEST = "from decimal import Decimal\nassert Decimal(f(1)) == Decimal('0.5')\n"


@pytest.mark.parametrize("tests,value", [
    (_FRACTION_TEST, {"D": "1e10000000"}),  # Fraction(Decimal('1e10000000')): 8.7 s, more with more digits
    (_FRACTION_TEST, {"D": "-1e-999999999"}),
    (_FRACTION_TEST, "1e10000000"),  # from text: 10**10000000
    (_FRACTION_TEST, "1" * 1_000_000 + "/3"),
    (_FRACTION_TEST, [{"q": [{"i": "f" * 2**15}, {"i": "e" * 2**15}]}] * 200),  # a gcd of two 2**17-bit ints each
    (_DECIMAL_TEST, "9" * 1_000_000),
    ("assert int(f(1)) == 3\n", "9" * 1_000_000),  # quadratic without a digit limit
    ("assert int(f(1)) == 3\n", {"D": "1e999999999"}),
    ("assert float(f(1)) == 3\n", "1" * 1_000_000),
    ("assert str(f(1)) == '3'\n", {"i": "f" * 2**20}),  # a 2**22-bit integer printed: 24 s
    ("assert str(f(1)) == '3'\n", [[{"i": "f" * 2**15}]] * 30),
    ("assert round(f(1), 10**9) == 3\n", 1.5),
    ("assert f(1) ** 3 == 3\n", {"D": "1e999999999"}),
    ("assert f(1) * 10**7 == 'x'\n", "x" * 1000),
    ("assert pow(7, f(1), 10**40) == 3\n", {"i": "f" * 2**15}),
    ("import math\nassert math.floor(f(1)) == 3\n", {"D": "1e999999999"}),
], ids=["fraction-of-decimal", "fraction-of-tiny-decimal", "fraction-of-text", "fraction-of-long-text",
        "fraction-gcd", "decimal-of-long-text", "int-of-text", "int-of-decimal", "float-of-text", "str-of-int",
        "str-of-nested-ints", "round-digits", "decimal-power", "repeat", "modular-power", "floor"])
def test_hostile_values_are_cheap_for_the_trainer_to_judge(no_digit_limit, tests, value):
    # what a hostile program can write on its data channel for a trusted test: judging it takes
    # the trainer (GIL held, beyond the reward's timeout) a bounded time. CPU time of the judging
    # thread: the costliest case here (str-of-nested-ints) takes about 0.6 s of it, quiet or
    # loaded, where its wall time went past 1 s with two busy loops beside the suite; without
    # the judge's bounds these take 8 s to hours
    from grpokit.rewards._judge import judge
    from grpokit.rewards._testplan import plan_tests

    plan = plan_tests(tests)
    assert plan.untrusted == 0
    cpu0 = thread_cpu()
    ((ok, why),) = judge(plan, {0: {"u": 0, "v": [value]}})
    assert thread_cpu() - cpu0 < 1.5 and not ok, why


def test_hostile_json_numbers_are_cheap_for_the_trainer_to_read(no_digit_limit):
    line = b'{"u": 0, "v": [' + b"9" * 2_000_000 + b']}\n{"u": 1, "v": [3]}\n'
    cpu0 = thread_cpu()
    assert _sandbox._lines(bytearray(line)) == [{"u": 1, "v": [3]}]
    assert thread_cpu() - cpu0 < 1.0


def test_hostile_fraction_of_a_huge_decimal():
    t0, cpu0 = time.monotonic(), thread_cpu()
    r = run_tests("from decimal import Decimal\ndef f(x):\n    return Decimal('1e10000000')\n", _FRACTION_TEST, timeout_s=3.0)
    _assert_contained(r, t0, 5.0)
    assert thread_cpu() - cpu0 < 1.0  # the trainer's side of the run: judging the value included
    assert r.untrusted == 0


def test_hostile_reads_a_check_definition_that_is_sent():
    # `alias = check` sends check()'s definition, expected values included: the inlined test is
    # then untrusted, so what the program reads there does not count with trusted_only
    tests = _CHECK + "alias = check\n"
    r = run_tests(_ASSERT_LEAK, tests, timeout_s=3.0)
    assert (r.passed, r.total, r.untrusted, r.untrusted_passed, r.trusted_total) == (1, 2, 1, 1, 1), r.detail
    comp = "```python\n" + _ASSERT_LEAK + "```"
    assert REGISTRY["code_tests"](["p"], [comp], timeout_s=3.0, trusted_only=True, tests=[tests]) == [0.0]


def test_hostile_prints_an_output_pattern_without_solving():
    cases = [{"input": "4\n", "output": "YES\n"}, {"input": "7\n", "output": "NO\n"}, {"input": "9\n", "output": "NO\n"}]
    t0 = time.monotonic()
    r = run_tests("print('YES')\n", cases, timeout_s=3.0)  # the right answer for one case only
    assert (r.status, r.passed, r.total) == ("failed", 1, 3) and time.monotonic() - t0 < under_load(6.0)
    assert REGISTRY["code_tests"](["p"], ["```python\nprint('YES')\n```"], timeout_s=3.0, tests=[cases])[0] < 1.0
    # all the answers at once, every token the pattern could need: the token count gives it away
    _assert_forgery_fails("print('YES NO')\nprint(12, 30, 1)\n", _IO_CASES)


# --------------------------------------------------------------------------- fallbacks


@pytest.fixture
def weak_mode(request):
    yield lambda mode: _sandbox.set_isolation(mode)
    _sandbox.set_isolation(None)


@pytest.mark.parametrize("mode", ["rlimits", "uid"])
def test_fallback_modes_still_time_out_and_reap(weak_mode, mode):
    if mode == "uid" and os.geteuid() != 0:
        pytest.skip("uid drop needs root")
    weak_mode(mode)
    ok = run_tests(ADD, "assert add(1, 1) == 2", timeout_s=5).status == "ok"
    if mode == "uid" and not ok:  # the last resort, "rlimits", must always work
        pytest.skip("the interpreter is not readable by a sandbox uid without a mount namespace (private home)")
    assert ok
    t0 = time.monotonic()
    assert run_tests("while True: pass", "assert True", timeout_s=1.0).status == "timeout"
    assert time.monotonic() - t0 < under_load(5.0)
    marker = f"fallback-{uuid.uuid4().hex}"
    prog = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True,\n"
        "                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    run_tests(prog, "assert True", timeout_s=2.0)
    assert _sandbox_leftovers(marker) == []
    assert not [d for d in os.listdir("/tmp") if d.startswith(f"grpokit-sbx-{os.getpid()}-")]


_CLAIMS_NOT_PLAIN = (
    "import gc\n"
    "def add(a, b):\n    return 0\n"
    "def _forge():\n"
    "    h = next(o for o in gc.get_objects() if type(o).__name__ == '_Harness')\n"
    "    for step in h.cfg['steps']:\n"
    "        if step[0] == 'eval':\n"
    "            h.send(u=step[1], v=[{'?': 'claimed'}] * len(step[2]))\n"
    "        elif step[0] != 'exec':\n"
    "            h.send(u=step[1], ok=True)\n"
    "_forge()\n"
)


def test_hostile_claims_every_value_is_not_plain_data_then_forges_the_second_run():
    """The "not plain data" marker travels on a channel the program controls. By default it only
    fails the test; opted in, the forged second-run verdicts count as untrusted and
    trusted_only scores them 0."""
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
    r = run_tests(_CLAIMS_NOT_PLAIN, tests, timeout_s=3)
    assert r.passed == 0 and r.status != "ok", r.detail
    fn = REGISTRY["code_tests"]
    comp = "```python\n" + _CLAIMS_NOT_PLAIN + "```"
    assert fn(["p"], [comp], timeout_s=3, tests=[tests]) == [0.0]
    assert fn(["p"], [comp], timeout_s=3, objects_in_sandbox=True, trusted_only=True, tests=[tests]) == [0.0]
