"""Sandbox launcher and harness for `grpokit.rewards.code`.

This file runs as its own process (`python -I -S _sandbox_launcher.py`, configuration as JSON on
stdin) and must only import the standard library: it is executed by path, never through the
`grpokit` package, so that nothing the trainer imported leaks in. The parent side lives in
`_sandbox.py`; the threat model is in docs/rewards.md ("Sandbox threat model").

Process tree (the names are the ones used in the docs):

    trainer ── launcher (new session; trusted, never runs untrusted code)
                 └── child (pid 1 of a new pid namespace when available) = harness + program
                       └── one process per stdin/stdout case (io tests only)

The launcher enters the namespaces, prepares the mounts, forks the child, waits for it, then
cleans up; its own events (the child's pid, a setup error) go to `result_fd`, which the child
closes before anything else. The child sets its limits, drops privileges and runs the harness.

Who decides that a test passed: never this file's child. The parent keeps the expected values
and sends only what must run: setup statements, the expressions whose values a test needs, the
stdin of each case. The harness sends back DATA on `data_fd` (values restricted to plain builtin
types, captured stdout, exit codes); the parent compares them with the expected values. The
program shares the harness's interpreter, so it can write anything to `data_fd`, but without the
expected values it can only forge data it could also have returned honestly. (The verdicts of
untrusted tests, and of the second run that `objects_in_sandbox` allows, are the exception: the
parent counts those as untrusted.)
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import io
import json
import os
import resource
import select
import signal
import sys
import types

EXIT_SETUP = 3  # the launcher failed before the program could start
EXIT_HARNESS = 4  # the harness itself failed (not the program)

# clone(2) / mount(2) / prctl(2) constants (Linux UAPI; identical on all architectures).
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
SYS_MOUNT_SETATTR = 442  # same number on every architecture (syscalls added after 5.1 are unified)
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# SECBIT_NOROOT | _LOCKED | SECBIT_NO_SETUID_FIXUP | _LOCKED | SECBIT_KEEP_CAPS_LOCKED: uid 0 never
# regains capabilities, on exec or otherwise
SECUREBITS_LOCKED_DOWN = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
SANDBOX_DIR = "/tmp"  # the sandbox's working directory when a mount namespace is available
SANDBOX_UID_BASE = 2_000_000_000  # + the launcher's pid (unique while it runs; pid_max <= 2**22)


# --------------------------------------------------------------------------- namespaces


def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


def _prctl(libc, option: int, arg: int) -> int:
    """prctl(2) where it exists (Linux); elsewhere a no-op that reports success."""
    return libc.prctl(option, arg, 0, 0, 0) if hasattr(libc, "prctl") else 0


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _overlays(needed: list[str], hide: list[str], untraversable: bool) -> dict[str, list[str]]:
    """Directories to cover with an empty tmpfs, each mapped to the needed paths below it that are
    bind-mounted back: the directories in `hide` (the trainer's home: keys, tokens), and with
    `untraversable` (a sandbox uid) the top-most directory on the way to a needed path that
    "others" cannot traverse (e.g. /root, mode 700, holding a pyenv Python)."""
    needed = sorted({os.path.realpath(p) for p in needed if p and os.path.isdir(p)})
    needed = [p for p in needed if not any(p != q and p.startswith(q + "/") for q in needed)]
    anchors = {os.path.realpath(h) for h in hide if h and os.path.isdir(h)} - {"/"}
    if untraversable:
        for p in needed:
            parts = p.strip("/").split("/")
            for k in range(1, len(parts)):
                anc = "/" + "/".join(parts[:k])
                if not os.stat(anc).st_mode & 0o001:
                    anchors.add(anc)
                    break
    anchors = {a for a in anchors if not any(a != b and a.startswith(b + "/") for b in anchors)}
    return {a: [p for p in needed if p == a or p.startswith(a + "/")] for a in sorted(anchors)}


def _setup_namespaces(cfg: dict) -> None:
    lay = cfg["layers"]
    flags = 0
    if lay["userns"]:
        flags |= CLONE_NEWUSER
    if lay["mountns"]:
        flags |= CLONE_NEWNS
    if lay["pidns"]:
        flags |= CLONE_NEWPID
    if lay["netns"]:
        flags |= CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if not flags:
        return
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(ctypes.c_int(flags)), "unshare")
    if lay["userns"]:  # map ourselves to root of the new user namespace (only this one id)
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                           ("/proc/self/gid_map", f"0 {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    if not lay["mountns"]:
        return
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates to the host
    for anc, subs in _overlays(cfg["expose"], cfg["hide"], lay["uid"] is not None).items():
        fds = [os.open(s, os.O_PATH | os.O_DIRECTORY) for s in subs]
        _mount(libc, "tmpfs", anc, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
        for s, fd in zip(subs, fds):
            os.makedirs(s, 0o755, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", s, None, MS_BIND | MS_REC)
            os.close(fd)
    _make_readonly(libc)
    owner = 0 if lay["uid"] is None else lay["uid"]
    _mount(libc, "tmpfs", SANDBOX_DIR, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['disk_mb']}m,nr_inodes=4096,mode=0700,uid={owner},gid={owner}")


def _make_readonly(libc) -> None:
    """Every mount read-only: one recursive mount_setattr (Linux >= 5.12), else remount each
    mount point, keeping the flags the kernel locks in a user namespace."""

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/",
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if ret == 0:
        return
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    keep = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
            os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
    failed = []
    for mp in points:
        try:
            fl = os.statvfs(mp).f_flag
            extra = sum(v for k, v in keep.items() if fl & k)
            _mount(libc, None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)
        except OSError:
            failed.append(mp)
    if "/" in failed:
        raise OSError(1, "cannot make / read-only")


# --------------------------------------------------------------------------- child side


def _set_limits(cfg: dict) -> None:
    cpu = int(cfg["timeout_s"]) + 2
    mem = int(cfg["memory_mb"]) * 2**20
    for res, val in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (mem, mem)),
                     (resource.RLIMIT_FSIZE, (cfg["file_mb"] * 2**20,) * 2),
                     (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
                     (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, val)


def _child(cfg: dict, go_r: int) -> None:
    lay = cfg["layers"]
    libc = _libc()
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # launcher gone => we are gone
    if os.read(go_r, 1) != b"g":  # wait until the launcher has reported our pid
        os._exit(EXIT_SETUP)  # the launcher died first
    if lay["pidns"] and lay["mountns"]:  # a /proc that shows only the sandbox's processes
        try:
            _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass  # e.g. a container masks parts of /proc; the host's stays (read-only, other pid ns)
    os.chdir(cfg["workdir"])
    os.umask(0o077)
    _set_limits(cfg)
    _check(_prctl(libc, PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    if lay["uid"] is not None:  # from root to a fresh uid: every capability goes with it
        os.setgroups([])
        os.setgid(lay["uid"])
        os.setuid(lay["uid"])
        _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)  # a credential change clears it
    else:
        _drop_capabilities(libc)
    os.set_blocking(go_r, False)
    try:
        if os.read(go_r, 1) == b"":  # end of file: the launcher died before we re-armed
            os._exit(EXIT_SETUP)
    except BlockingIOError:
        pass  # still alive: it holds the write end until it exits
    os.close(go_r)
    _Harness(cfg).run()


def _drop_capabilities(libc) -> None:
    """Leave the program no capability at all: without this, root in its user namespace (or a
    root trainer without a sandbox uid) could simply remount / read-write, or mount anything."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    def caps(field: str) -> int:
        with open("/proc/self/status") as f:
            vals = [ln.split()[1] for ln in f if ln.startswith(field + ":")]
        return int(vals[0], 16) if vals else 0

    if not hasattr(libc, "capset") or not os.path.exists("/proc/self/status") or caps("CapPrm") == 0:
        return  # an unprivileged process outside a user namespace: nothing to drop
    _check(_prctl(libc, PR_SET_SECUREBITS, SECUREBITS_LOCKED_DOWN), "securebits")
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _prctl(libc, PR_CAPBSET_DROP, cap)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")  # _LINUX_CAPABILITY_VERSION_3
    if caps("CapEff") or caps("CapPrm"):
        raise OSError(1, "capabilities still present")


def _reap_uid(uid: int) -> None:
    """Kill every process of the sandbox uid (used when there is no pid namespace)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)  # all processes this uid may signal, except us
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _reap_marker(token: str) -> None:
    """Best effort without pid namespace or uid: kill processes whose environment carries the
    sandbox token (a process that re-executes with a clean environment escapes this)."""
    me = os.getpid()
    needle = f"GRPOKIT_SANDBOX={token}".encode()
    if not os.path.isdir("/proc"):
        return
    for _ in range(3):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass


def main() -> None:
    # Die with the trainer thread that started us (it waits for us, so it never exits first on
    # its own); the child dies with us in turn, and with it the whole pid namespace.
    _prctl(_libc(), PR_SET_PDEATHSIG, signal.SIGKILL)
    cfg = json.loads(sys.stdin.buffer.read())
    if os.getppid() != cfg["parent_pid"]:
        os._exit(EXIT_SETUP)
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    rfd, dfd = cfg["result_fd"], cfg["data_fd"]
    emit = lambda obj: os.write(rfd, (json.dumps(obj) + "\n").encode())  # noqa: E731
    lay = cfg["layers"]
    lay["uid"] = SANDBOX_UID_BASE + os.getpid() if lay["uid"] else None
    try:
        if lay["uid"] is not None and not lay["mountns"]:
            os.chown(cfg["workdir"], lay["uid"], lay["uid"])
        _setup_namespaces(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which falls back
        emit({"ev": "setup_error", "msg": f"{type(e).__name__}: {e}"})
        os._exit(EXIT_SETUP)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)  # the launcher's channel: the program must never hold it
        code = EXIT_HARNESS
        try:
            os.close(go_w)
            _child(cfg, go_r)
            code = 0
        except BaseException as e:  # noqa: BLE001
            try:
                msg = {"ev": "harness_error", "msg": f"{type(e).__name__}: {e}"[:500]}  # a hint, not a verdict
                os.write(dfd, (json.dumps(msg) + "\n").encode())
            except BaseException:  # noqa: BLE001
                pass
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001 - replaced or closed by the program
                pass
        os._exit(code)
    os.close(dfd)  # only the child writes data; the parent sees end of file when it is gone
    os.close(go_r)
    # SIGTERM from the parent means "time is up": kill the child (pid 1 of the namespace takes
    # every process in it along), then fall through to the cleanup below.
    reaped = []
    signal.signal(signal.SIGTERM, lambda *_: reaped or os.kill(pid, signal.SIGKILL))
    # Backstop for a parent that stopped watching: our own wall-clock limit, well past its.
    signal.signal(signal.SIGALRM, lambda *_: reaped or os.kill(pid, signal.SIGKILL))
    signal.alarm(int(cfg["timeout_s"] + cfg["startup_s"]) + 5)
    emit({"ev": "pid", "pid": pid})
    os.close(rfd)
    os.write(go_w, b"g")  # go_w stays open until we exit: the child's proof that we live
    _, status = os.waitpid(pid, 0)
    reaped.append(True)
    if not lay["pidns"]:
        if lay["uid"] is not None:
            _reap_uid(lay["uid"])
        else:
            _reap_marker(cfg["token"])
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


# --------------------------------------------------------------------------- harness
# Runs in the child. For assert tests the program shares this interpreter, so nothing here is
# trusted: the harness only evaluates what the parent asks for and sends the values back as data.

VALUE_CAP = 2**20  # budget for one encoded value (nodes + characters); more is sent as an error
EXIT_MEMORY = 5  # exit code of an io case process that ran out of memory


class _NotData(Exception):
    """A value the parent would not accept (too large, or too deeply nested, to send)."""


class _NotPlain(_NotData):
    """A value of a type that does not travel (the program's own class, a dict view, ...); the
    parent may then ask for the test's own verdict in a second run (untrusted)."""


def encode_value(x, budget: list | None = None, depth: int = 0):
    """`x` as JSON-ready data; `_values.decode_value` in the parent is the inverse.

    None, bool, int (64-bit), float and str travel as themselves, list as a JSON array; the rest
    as a one-key object: {"i": hex} larger int, {"t": [...]} tuple, {"S": [...]} set,
    {"F": [...]} frozenset, {"d": [[k, v], ...]} dict, {"c": [re, im]} complex, {"y": hex} bytes,
    {"q": [num, den]} Fraction, {"D": text} Decimal. Types are checked with `type(x) is ...`:
    a subclass of int could bring its own __eq__, so it is refused (raises _NotPlain). numpy
    scalars go as their `.item()`. The parent re-checks all of this: whatever this process sends,
    it can only rebuild plain values from it.
    """
    if budget is None:
        budget = [VALUE_CAP]
    t = type(x)
    _spend(budget, 1 + (len(x) if t is str else 2 * len(x) if t is bytes else 0), depth)
    if x is None or t is bool or t is float or t is str:
        return x
    if t is int:
        if -(2**63) < x < 2**63:
            return x
        _spend(budget, x.bit_length() // 4, depth)
        return {"i": format(x, "x")}  # hex: no digit limit, unlike int(str) for decimal text
    if t is list:
        return [encode_value(v, budget, depth + 1) for v in x]
    tag = {tuple: "t", set: "S", frozenset: "F"}.get(t)
    if tag:
        return {tag: [encode_value(v, budget, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[encode_value(k, budget, depth + 1), encode_value(v, budget, depth + 1)] for k, v in x.items()]}
    if t is complex:
        return {"c": [x.real, x.imag]}
    if t is bytes:
        return {"y": x.hex()}
    try:
        mod, name = str(getattr(t, "__module__", "")), str(getattr(t, "__qualname__", ""))
    except BaseException:  # noqa: BLE001 - a metaclass of the program's that raises
        raise _NotPlain("a value of the program's own class is not plain data") from None
    if (mod, name) == ("fractions", "Fraction"):
        return {"q": [encode_value(x.numerator, budget), encode_value(x.denominator, budget)]}
    if mod in ("decimal", "_decimal", "_pydecimal") and name == "Decimal":
        return {"D": str(x)[:1000]}
    if mod == "numpy" and name != "ndarray" and hasattr(x, "item"):
        item = x.item()
        if type(item) in (bool, int, float, complex):
            return encode_value(item, budget, depth + 1)
    raise _NotPlain(f"a {mod[:60]}.{name[:60]} is not plain data (int, float, str, bytes, list, tuple, dict, ...)")


def _spend(budget: list, n: int, depth: int) -> None:
    budget[0] -= n
    if budget[0] < 0 or depth > 100:
        raise _NotData("value too large or too deeply nested to send")


def _name(e: BaseException) -> str:
    try:
        return str(type(e).__name__)[:100]
    except BaseException:  # noqa: BLE001 - the program's exception class, possibly hostile
        return "exception"


_TRUSTED_DIRS: tuple[str, ...] = ()  # the interpreter's own library dirs, set before the program runs


_COMPARISONS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__contains__")


def _own_comparison(obj, budget: list) -> bool:
    """True if `obj` (or an element inside it) brings its own comparison (`__eq__`, `__lt__`,
    `__contains__`, ...): one defined in Python by a class whose code does not come from a file of
    the interpreter's libraries (stdlib `Fraction` is fine; a class written or patched by the
    program is not)."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    for cls in type(obj).__mro__:
        if not cls.__flags__ & (1 << 9):  # not Py_TPFLAGS_HEAPTYPE: a C type, trusted
            continue
        for name in _COMPARISONS:
            fn = cls.__dict__.get(name)
            if fn is None:
                continue
            path = getattr(getattr(fn, "__code__", None), "co_filename", "")
            if not (type(path) is str and path.startswith(_TRUSTED_DIRS) and os.path.isfile(path)):
                return True
    if type(obj) in (list, tuple, set, frozenset):
        return any(_own_comparison(x, budget) for x in obj)
    if type(obj) is dict:
        return any(_own_comparison(k, budget) or _own_comparison(v, budget) for k, v in obj.items())
    return False


class _Refused(Exception):
    """A comparison the guard below refuses: the assert fails, even under `not`."""


_GUARDED = {"Eq": lambda a, b: a == b, "NotEq": lambda a, b: a != b, "Lt": lambda a, b: a < b,
            "LtE": lambda a, b: a <= b, "Gt": lambda a, b: a > b, "GtE": lambda a, b: a >= b,
            "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b}  # by ast operator name


def _guarded_compare(left, right, op: str) -> bool:
    """`left <op> right` in an assert the sandbox judges (an untrusted test, or the second run for
    a value that is not plain data), with the classic reward hack closed: when only one side
    brings its own comparison, the other being plain, it is refused ("always equal" objects:
    `f(x) == 3`, `3 == f(x)`, `f(x) in [3]`, `abs(f(x) - 3) < tol`). Both sides the program's
    own (`mk(1) == P(1)`) compare as written."""
    if _own_comparison(left, [10_000]) != _own_comparison(right, [10_000]):
        raise _Refused("a value with its own comparison compared with a plain value")
    return _GUARDED[op](left, right)


class _GuardEq(ast.NodeTransformer):
    """Route every single comparison inside an assert through `_guarded_compare` (chains are
    left alone: a speed bump, since these verdicts are counted as untrusted anyway)."""

    def visit_Assert(self, node):
        node.test = _GuardCompare().visit(node.test)
        return node


class _GuardCompare(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        op = type(node.ops[0]).__name__
        if len(node.ops) != 1 or op not in _GUARDED:
            return node
        args = [node.left, node.comparators[0], ast.Constant(op)]
        return ast.copy_location(ast.Call(ast.Name("__grpokit_cmp__", ast.Load()), args, []), node)


class _Harness:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.fd = cfg["data_fd"]
        # Bound before the program runs. Not for security (this process only ever sends data),
        # but so that a program that replaces builtins or json still has its values delivered.
        self._write, self._dumps = os.write, json.dumps
        self._exec, self._eval, self._compile = exec, eval, compile
        self.memory = False  # a MemoryError was seen: reported as status "memory"

    def send(self, **obj) -> None:
        data = memoryview((self._dumps(obj) + "\n").encode())
        while data:
            data = data[self._write(self.fd, data):]

    def run(self) -> None:
        global _TRUSTED_DIRS
        cfg = self.cfg
        import site  # the module only: site-packages on sys.path, .pth files not executed (fast)

        sites = [d for d in site.getsitepackages() if os.path.isdir(d)]
        if cfg["site"]:
            sys.path.extend(d for d in sites if d not in sys.path)
        dirs = [os.path.dirname(os.__file__)] + sites
        _TRUSTED_DIRS = tuple({os.path.realpath(d) + "/" for d in dirs} | {d + "/" for d in dirs})
        try:
            code = compile(cfg["program"], "<program>", "exec")
        except BaseException as e:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), MemoryError
            self.send(ev="done", status="crashed", msg=f"program does not compile: {type(e).__name__}: {e}"[:500])
            return
        if cfg["mode"] == "io":
            self._run_io(code, cfg["steps"])  # the stdin of each case
        else:
            self._run_asserts(code, cfg["steps"])

    # ---------------------------------------------------------------- assert tests

    def _run_asserts(self, code, steps: list) -> None:
        """The program, then the parent's steps in order: ["exec", src] a setup statement,
        ["eval", i, [src, ...]] the expressions test i needs (their values are sent), ["run", i,
        src] a test the parent cannot split (only whether it raised is sent)."""
        ns = _module_namespace("__solution__")
        sys.stdin = io.StringIO("")
        self.send(ev="start")
        try:
            self._exec(code, ns)  # noqa: S102 - untrusted by design; this whole process is the sandbox
        except MemoryError:
            self.send(ev="done", status="memory", msg="MemoryError while running the program")
            return
        except BaseException as e:  # noqa: BLE001 - incl. SystemExit: the tests never ran
            self.send(ev="done", status="crashed", msg=f"program raised {_name(e)}")
            return
        ns["__grpokit_cmp__"] = _guarded_compare
        for step in steps:
            if step[0] == "exec":
                self._statement(step[1], ns)
            elif step[0] == "eval":
                self.send(u=step[1], v=[self._value(src, ns) for src in step[2]])
            else:
                self.send(u=step[1], ok=self._statement(step[2], ns))
        self.send(ev="done", status="memory" if self.memory else "ran")

    def _statement(self, src: str, ns: dict) -> bool:
        """Run one statement of the tests; False if it raised. Its asserts get the "always
        equal" guard: only the verdicts of "run" steps depend on it, and those are forgeable
        anyway (they are counted as untrusted), so it is a speed bump, not a wall."""
        try:
            try:
                tree = ast.fix_missing_locations(_GuardEq().visit(ast.parse(src, "<tests>", "exec")))
            except RecursionError:  # a very deeply nested expression: run it as written
                tree = ast.parse(src, "<tests>", "exec")
            self._exec(self._compile(tree, "<tests>", "exec"), ns)  # noqa: S102
            return True
        except MemoryError:
            self.memory = True
        except BaseException:  # noqa: BLE001 - a failing test, whatever it raised
            pass
        return False

    def _value(self, src: str, ns: dict):
        """The value of one expression as data, {"?": why} when its type does not travel, or
        {"!": why} when it raised or is too large to send."""
        try:
            return encode_value(self._eval(self._compile(src, "<tests>", "eval"), ns))  # noqa: S307
        except MemoryError:
            self.memory = True
            return {"!": "MemoryError"}
        except _NotPlain as e:
            return {"?": str(e)}
        except _NotData as e:
            return {"!": str(e)}
        except BaseException as e:  # noqa: BLE001
            return {"!": f"raised {_name(e)}"}

    # ---------------------------------------------------------------- stdin/stdout tests

    def _run_io(self, code, inputs: list) -> None:
        """Each case in a fresh process forked from here before any of the program's code ran in
        this one: no state carries over between cases, and the only channel a case has is its
        stdout, which the parent compares with the expected output it never sent."""
        self.send(ev="start")
        for i, text in enumerate(inputs):
            out, rc, over = self._case(code, text)
            self.memory = self.memory or rc == EXIT_MEMORY
            self.send(u=i, out=out, rc=rc, over=over)
        self.send(ev="done", status="memory" if self.memory else "ran")

    def _case(self, code, text: str) -> tuple[str, int, bool]:
        stdin = _stdin_fd(text)
        r, w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered here may be written twice by the fork
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os._exit(_run_case(code, stdin, w))
        os.close(w)
        os.close(stdin)
        try:
            out, over = _read_capped(r, pid, self.cfg["output_cap"])
        finally:
            os.close(r)
        _, status = os.waitpid(pid, 0)
        return out, os.waitstatus_to_exitcode(status), over


def _module_namespace(name: str) -> dict:
    """The globals of a real module registered under `name`: dataclasses, typing and pickle
    look the program's classes up in sys.modules (a bare dict made `@dataclass` with string
    annotations raise AttributeError)."""
    module = types.ModuleType(name)
    module.__builtins__ = builtins
    sys.modules[name] = module
    return module.__dict__


def _stdin_fd(text: str) -> int:
    """A readable descriptor holding `text` (an anonymous memory file; a pipe could not take a
    large input before the reader starts)."""
    data = text.encode()
    try:
        fd = os.memfd_create("stdin")
    except (AttributeError, OSError):  # not Linux, or an old kernel: a nameless file in the workdir
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_case(code, stdin_fd: int, out_fd: int) -> int:
    """In the case's own process: stdin and stdout wired, every other descriptor closed (the
    data channel included), the program run as __main__. Returns the exit code (0: clean exit)."""
    try:
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.closerange(3, 1024)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = out = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    except BaseException:  # noqa: BLE001
        return EXIT_HARNESS
    try:
        exec(code, _module_namespace("__main__"))  # noqa: S102
        rc = 0
    except SystemExit as e:
        rc = 0 if e.code is None or e.code == 0 else 1
    except MemoryError:
        rc = EXIT_MEMORY
    except BaseException:  # noqa: BLE001
        rc = 1
    try:
        out.flush()
    except BaseException:  # noqa: BLE001 - e.g. the pipe was closed after a flood
        rc = rc or 1
    return rc


def _read_capped(fd: int, pid: int, cap: int) -> tuple[str, bool]:
    """A case's stdout, at most `cap` bytes (over=True and the process killed when it writes
    more). Stops at end of file, or once the process has exited and the pipe is drained: a
    background process it left behind may hold the pipe open."""
    buf, exited = bytearray(), False
    while True:
        ready, _, _ = select.select([fd], [], [], 0 if exited else 0.05)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > cap:
                os.kill(pid, signal.SIGKILL)
                return buf[:cap].decode("utf-8", "replace"), True
        elif exited:
            break
        else:  # WNOWAIT: look, do not reap (the caller waits for the exit status)
            exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    return buf.decode("utf-8", "replace"), False


if __name__ == "__main__":
    main()
