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
    assert took < 8.0, took  # the two hung ones overlap (about 1.5 s); a blocked batch never ends


def test_batch_deduplicates_identical_jobs():
    res = run_tests_batch([ADD] * 5, ["assert add(1, 1) == 2"] * 5, timeout_s=2)
    assert all(r is res[0] for r in res)


# --------------------------------------------------------------------------- hostile suite


def _assert_contained(r, t0, limit_s):
    took = time.monotonic() - t0
    assert r.status != "ok" and r.passed == 0, (r.status, r.passed, r.detail, r.stdout[-300:], r.stderr[-300:])
    assert took < limit_s, took


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
    deadline = time.monotonic() + 3.0
    while _sandbox_leftovers(marker, owner=proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandbox_leftovers(marker, owner=proc.pid) == []


def test_trainer_process_is_unharmed():
    cwd, env = os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
    run_tests_batch(["import os\nos.chdir('/')\nos.environ.clear()", "while True: pass"], ["assert True"] * 2, timeout_s=1.0)
    assert os.getcwd() == cwd and dict(os.environ) == env
    assert {s: signal.getsignal(s) for s in handlers} == handlers


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
    assert time.monotonic() - t0 < 5.0
    marker = f"fallback-{uuid.uuid4().hex}"
    prog = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True,\n"
        "                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    )
    run_tests(prog, "assert True", timeout_s=2.0)
    assert _sandbox_leftovers(marker) == []
    assert not [d for d in os.listdir("/tmp") if d.startswith(f"grpokit-sbx-{os.getpid()}-")]
