"""Code correctness: run the completion's last fenced Python block against unit tests in a sandbox.

    code_tests = passed / total            (all_or_nothing=True: 1.0 only if every test passed)

Tests come from a dataset column (`tests` by default) in one of two forms:
- an assert script: every top-level `assert` (or top-level call of a function the tests define,
  such as `check(f)`) is one test, run in order in the program's namespace after the program
  (`__name__` is not "__main__"); other statements (`random.seed(0)`, `x = f(3)`) are setup;
- stdin/stdout cases: `[{"input": ..., "output": ...}, ...]` or `{"inputs": [...], "outputs": [...]}`
  (or that as JSON text); the program runs once per case, in a fresh process, as `__main__`;
  whitespace-insensitive comparison, numbers within 1e-6.

Who decides a test passed: the trainer, never the sandboxed process. The sandbox only evaluates
expressions (`add(1, 2)`) and runs programs on stdin; it sends back plain data (values of builtin
types, captured stdout), and the trainer compares that with expected values it never sent. Tests
it cannot judge that way (e.g. a loop of asserts inside `check`, or, with `objects_in_sandbox`, a
value of the program's own class, which otherwise fails) are reported by the sandbox and counted in
`CodeResult.untrusted`: a hostile program can
forge those (`trusted_only=True` leaves them out). docs/rewards.md has the details and the threat
model.

Scores: no code block -> 0.0; a program that does not compile, crashes, times out or exceeds its
memory -> the fraction it passed before (usually 0.0); tests that do not parse, or a sandbox that
fails to start -> None (not the model's fault); with `trusted_only=True`, tests none of which the
trainer can judge itself -> None (no signal rather than a flat 0).

The sandbox (`_sandbox.py`, `_sandbox_launcher.py`, threat model in docs/rewards.md) runs each
program in a fresh process tree with limits, namespaces where the machine allows, and a hard
wall-clock kill; `run_tests_batch` runs many at once, bounded by the number of cores.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from ._sandbox import CodeResult, Isolation, isolation, run_job, set_isolation  # noqa: F401
from .registry import diagnoses, read_column, register

_OPEN = re.compile(r"[ \t]*```[ \t]*([A-Za-z0-9_+-]*)")
_CLOSE = re.compile(r"[ \t]*```[ \t]*")
_PYTHON = {"python", "py", "python3", "py3"}


def extract_code(completion: str) -> str | None:
    """The last fenced block tagged python (``` python / py / python3), else the last untagged
    fenced block; None if there is none. An unclosed fence (truncated completion) is ignored.
    One pass over the lines (a regex over the whole text is quadratic on many open fences)."""
    if not isinstance(completion, str):
        return None
    tagged, untagged = None, None
    lang, body = None, []  # lang is None outside a block
    for line in completion.split("\n"):
        if lang is None:
            m = _OPEN.match(line)
            if m:
                lang, body = m.group(1).lower(), []
        elif _CLOSE.fullmatch(line):
            code = "\n".join(body) + "\n"
            if lang in _PYTHON:
                tagged = code
            elif not lang:
                untagged = code
            lang = None
        else:
            body.append(line)
    code = tagged if tagged is not None else untagged
    return code if code is not None and code.strip() else None


def run_tests(program: str, tests, *, timeout_s: float = 5.0, memory_mb: int = 512, nproc: int = 32,
              file_mb: int = 16, disk_mb: int = 64, output_cap: int = 16384,
              objects_in_sandbox: bool = False) -> CodeResult:
    """Run `program` against `tests` in a fresh sandbox and report what passed.

    timeout_s: wall-clock limit of the program + tests (CPU limit is timeout_s + 2 s).
    memory_mb: address-space limit. nproc: process limit. file_mb: largest file it may write.
    disk_mb: size of its private /tmp (mount namespace only). output_cap: bytes kept of
    stdout/stderr each (and of each stdin/stdout case's output). Never raises for anything the
    program does. `CodeResult.untrusted` counts the tests whose verdict had to come from inside
    the sandbox (see the module docstring). objects_in_sandbox: a test whose value is an object of
    the program's own class (not plain data) is judged in the sandbox, untrusted, instead of failing
    (for tasks whose answers are objects, e.g. linked lists; a hostile program can forge those).
    """
    return run_job(program, tests, timeout_s=timeout_s, memory_mb=memory_mb, nproc=nproc,
                   file_mb=file_mb, disk_mb=disk_mb, output_cap=output_cap, objects_in_sandbox=objects_in_sandbox)


def default_parallelism() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def run_tests_batch(programs: list[str], tests: list, *, max_workers: int | None = None,
                    **kwargs) -> list[CodeResult]:
    """`run_tests` over aligned lists, at most `max_workers` (default: the number of cores) at
    once. Identical (program, tests) pairs run once. Returns results in input order."""
    if len(programs) != len(tests):
        raise ValueError(f"{len(programs)} programs but {len(tests)} test sets")
    key = lambda i: (programs[i], tests[i] if isinstance(tests[i], str) else repr(tests[i]))  # noqa: E731
    first: dict = {}
    for i in range(len(programs)):
        first.setdefault(key(i), i)
    unique = sorted(set(first.values()))
    run = lambda i: run_tests(programs[i], tests[i], **kwargs)  # noqa: E731
    workers = max(1, min(max_workers or default_parallelism(), len(unique) or 1))
    if workers == 1:
        done = {i: run(i) for i in unique}
    else:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            done = dict(zip(unique, ex.map(run, unique)))
    return [done[first[key(i)]] for i in range(len(programs))]


@register("code_tests", own_time_limit=True, columns=["{tests_column}"])
def code_tests(prompts, completions, *, tests_column: str = "tests", all_or_nothing: bool = False,
               trusted_only: bool = False, timeout_s: float = 5.0, memory_mb: int = 512,
               max_workers: int | None = None, objects_in_sandbox: bool = False, **columns) -> list[float | None]:
    """Fraction of the tests the completion's program passes (see the module docstring).

    trusted_only: score only the tests the trainer judges itself: its passes over
    `CodeResult.trusted_total`; a test whose verdict came from inside the sandbox (a value that
    was not plain data) counts as failed, and a test set without such tests scores None.
    objects_in_sandbox: see `run_tests` (off: a value of the program's own class fails its test).
    """
    tests = read_column("code_tests", tests_column, columns, len(completions))
    programs = [extract_code(c) for c in completions]
    todo = [i for i, (p, t) in enumerate(zip(programs, tests)) if p is not None and t is not None]
    results = run_tests_batch([programs[i] for i in todo], [tests[i] for i in todo], max_workers=max_workers,
                              timeout_s=timeout_s, memory_mb=memory_mb, objects_in_sandbox=objects_in_sandbox)
    scores: list[float | None] = [None if t is None else 0.0 for t in tests]
    for i, res in zip(todo, results):
        scores[i] = _score(res, all_or_nothing, trusted_only)
    return scores


def _score(res: CodeResult, all_or_nothing: bool, trusted_only: bool) -> float | None:
    """passed / total; with trusted_only, the trainer's own passes over the tests it can judge
    (`trusted_total`, fixed by the tests: a program cannot shrink it), None when there are none."""
    if res.status == "error" or res.total == 0 or (trusted_only and res.trusted_total == 0):
        return None
    if trusted_only:
        passed, total = res.passed - res.untrusted_passed, res.trusted_total
        finished = res.status in ("ok", "failed")  # failures left are the untrusted tests'
    else:
        passed, total, finished = res.passed, res.total, res.status == "ok"
    if all_or_nothing:
        return 1.0 if finished and passed == total else 0.0
    return passed / total


def failure(res: CodeResult | None) -> str | None:
    """Why a program failed its tests, in words (the failing test and its error), or None when it
    passed or could not be run; `res` None: there was no program."""
    if res is None:
        return "it has no fenced code block to run"
    if res.status in ("ok", "error"):
        return None
    if res.status == "crashed":
        return f"the program fails before its tests: {res.detail}"
    if res.status in ("timeout", "memory"):
        what = "time" if res.status == "timeout" else "memory"
        test = f" on {res.failed_test}" if res.failed_test else ""
        return f"the program runs out of {what}{test} ({res.detail}); {res.passed} of {res.total} tests pass"
    why = res.detail.split(": ", 1)[1] if ": " in res.detail else res.detail
    test = f"the test {res.failed_test}" if res.failed_test else res.detail.split(": ", 1)[0]
    return f"{test} fails ({why}); {res.passed} of {res.total} tests pass"


@diagnoses(code_tests)
def _code_diagnosis(prompts, completions, *, tests_column: str = "tests", timeout_s: float = 5.0,
                    memory_mb: int = 512, max_workers: int | None = None, objects_in_sandbox: bool = False,
                    **columns) -> list[str | None]:
    """Each completion's failure (`failure`), from a fresh run of its program (a diagnosis is asked
    for the few completions rewritten per step)."""
    tests = read_column("code_tests", tests_column, columns, len(completions))
    programs = [extract_code(c) for c in completions]
    todo = [i for i, (p, t) in enumerate(zip(programs, tests)) if p is not None and t is not None]
    results = run_tests_batch([programs[i] for i in todo], [tests[i] for i in todo], max_workers=max_workers,
                              timeout_s=timeout_s, memory_mb=memory_mb, objects_in_sandbox=objects_in_sandbox)
    out: list[str | None] = [failure(None) if p is None and t is not None else None for p, t in zip(programs, tests)]
    for i, res in zip(todo, results):
        out[i] = failure(res)
    return out
