"""Trusted side of the code sandbox, part 1: turn the tests into a plan.

`plan_tests(tests)` splits assert-style tests so that the sandbox evaluates only the expressions
that depend on the program (`add(1, 2)`), while the predicate and every expected value stay in the
trainer (`_ == 3`); stdin/stdout tests become (stdin, expected stdout) pairs whose expected output
never leaves the trainer. `_judge.py` judges the plain data the sandbox sends back. See "Who
decides a test passed" in docs/rewards.md.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import json
import math
import re
from dataclasses import dataclass

from ._values import _teval

# --------------------------------------------------------------------------- test plans
# Trusted side of "who decides a test passed" (docs/rewards.md). The parent turns the tests into
# steps for the sandbox, which never contain the expected value of a test the parent judges
# itself, and keeps what it needs to judge the data that comes back. Untrusted code only ever
# produces data; every comparison with an expected value happens here.


def parse_io_tests(tests) -> list[tuple[str, str]] | None:
    """stdin/stdout cases from `[{"input","output"}, ...]`, `{"inputs":[...],"outputs":[...]}`
    or the same as a JSON string; None when `tests` is not in one of these forms."""
    if isinstance(tests, str):
        s = tests.lstrip()
        if not s.startswith(("[", "{")):
            return None
        try:
            tests = json.loads(s)
        except ValueError:
            return None
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        ins, outs = tests["inputs"], tests["outputs"]
        if isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs):
            return [(str(i), str(o)) for i, o in zip(ins, outs)]
        return None
    if isinstance(tests, list) and all(isinstance(c, dict) and "input" in c and "output" in c for c in tests):
        return [(str(c["input"]), str(c["output"])) for c in tests]
    return None


@dataclass(frozen=True)
class _Check:
    """How the parent judges one assert-style test.

    pred: the test's condition with every sub-expression the sandbox must evaluate replaced by
    a marker name `#k` (k = index into the values it sends back); None for a test the parent
    cannot split, whose pass/fail is reported by the sandbox (forgeable: `trusted` is False).
    trusted: every value the sandbox sends for this test is the program's own output (see
    `_AssertPlanner.owned`), so forging one is no different from the program returning it: the
    test's expected values and its checking logic never leave this process.
    redo: the test's own asserts as source, run by the sandbox in a second run when a value it
    needs is not plain data (that verdict is untrusted); None when it cannot be written out.
    """

    pred: ast.expr | None
    leaves: int
    trusted: bool
    src: str  # the test's source, shortened, for CodeResult.detail
    redo: str | None = None


@dataclass(frozen=True)
class TestPlan:
    """Immutable (plans are cached per test text and shared between runs and threads)."""

    __test__ = False  # not a pytest test class

    mode: str  # "assert" | "io"
    steps: tuple  # what the sandbox runs (JSON): assert steps, or the stdin of each io case
    checks: tuple  # assert: one _Check per test; io: the expected stdout of each case

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def untrusted(self) -> int:
        """Tests whose verdict always comes from the sandbox (fixed by the tests' form)."""
        return sum(1 for c in self.checks if isinstance(c, _Check) and not c.trusted)

    def describe(self, i: int) -> str:
        """Test `i` in a few words, for a diagnosis: its source (assert tests), or the input and the
        output it expects (stdin/stdout cases)."""
        if self.mode == "io":
            return _short(f"with input {self.steps[i]!r} (expected output {self.checks[i]!r})")
        return self.checks[i].src

    def redo_steps(self, tests) -> list:
        """The steps of a second run in which each test of `tests` runs its own asserts in the
        sandbox (a value it needs was not plain data); every other step as in the first run, so
        the program sees the same sequence of calls. Only these tests' expected values are sent."""
        redo = set(tests)
        return [["run", s[1], self.checks[s[1]].redo] if s[0] == "eval" and s[1] in redo else list(s)
                for s in self.steps]


def plan_tests(tests) -> TestPlan:
    """The plan for `tests` (an assert script or stdin/stdout cases); ValueError if unusable.
    Plans of test text are cached: a test set is planned once, not once per completion."""
    return _plan_text(tests) if isinstance(tests, str) else _plan(tests)


@functools.lru_cache(maxsize=256)  # a batch has a few dozen test sets
def _plan_text(tests: str) -> TestPlan:
    return _plan(tests)


def _plan(tests) -> TestPlan:
    cases = parse_io_tests(tests)
    if cases is not None:
        return TestPlan("io", tuple(i for i, _ in cases), tuple(o for _, o in cases))
    if not isinstance(tests, str):
        raise ValueError(f"tests must be a Python script or stdin/stdout cases, got {type(tests).__name__}")
    try:
        tree = ast.parse(tests, "<tests>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"tests do not parse: {e}") from None
    return _AssertPlanner(tree, tests).plan()


class _AssertPlanner:
    """Every top-level `assert` is one test, and so is every top-level call of a function the
    tests define (HumanEval's `check(candidate)`); all other statements are setup (`x = f(3)`,
    `random.seed(0)`), run in order in the sandbox.

    An assert becomes an "eval" step: the sandbox evaluates its leaves (see `_Cutter`) at the
    assert's place in the sequence and sends their values. A call of a test function whose body
    is only asserts (`def check(candidate): assert candidate(1) == 2 ...`) is inlined the same
    way, and the function's definition is then not sent at all (its constants are the expected
    values). Any other call becomes a "run" step whose verdict comes from the sandbox, and so
    does a test the planner cannot split (say, too deeply nested: RecursionError).
    """

    def __init__(self, tree: ast.Module, text: str):
        self.tree = tree
        self.lines = [line.encode() for line in _LINES.findall(text)]  # as the tokenizer splits them
        self.bound = _bindings(tree)
        self.star = any(k.endswith(".*") for kinds in self.bound.values() for k in kinds)
        self.defs = {s.name: s for s in tree.body
                     if isinstance(s, ast.FunctionDef) and self.bound.get(s.name) == ["def"]}
        self.test_functions = {s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.depends: dict[ast.AST, bool] = {}  # _Cutter._depends, memoised per node
        self.program_vars: set[str] = set()
        for s in tree.body:  # `sol = Solution()`, `res = f(x)`: test variables holding program output
            if (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
                    and self.bound.get(s.targets[0].id) == ["assign"] and self.owned(s.value)):
                self.program_vars.add(s.targets[0].id)

    def imported(self, node: ast.expr) -> tuple[str, str] | None:
        """(module, name) when `node` is `name` from `from module import name [as x]`, or
        `module.name` after `import module`, and the tests bind it no other way."""
        if isinstance(node, ast.Name):
            kinds = set(self.bound.get(node.id, ()))
            if len(kinds) == 1 and not self.star and (kind := kinds.pop()).startswith("from "):
                mod, _, name = kind[5:].rpartition(".")
                return mod, name
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            kinds = set(self.bound.get(node.value.id, ()))
            if len(kinds) == 1 and not self.star and (kind := kinds.pop()).startswith("import "):
                return kind[7:], node.attr
        return None

    def owned(self, node: ast.expr) -> bool:
        """Whether an expression the sandbox evaluates yields the program's own output: its
        outermost call/attribute/subscript chain starts at a name of the program (one the tests
        neither bind nor take from builtins), e.g. `add(1, x)`, `f(x)[0]`, `Solution().run(3)`.
        Otherwise it runs test or builtin logic the program could patch (`is_valid(f(x))`,
        `EXPECTED`, `repr(f(x))`), and the test's verdict is not trusted."""
        while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        if not isinstance(node, ast.Name):
            return False
        return node.id in self.program_vars or (node.id not in self.bound and not self.star
                                                and node.id not in _BUILTIN_NAMES)

    def plan(self) -> TestPlan:
        steps, checks, stmts, origin, defined = [], [], [], {}, set()
        for stmt in self.tree.body:
            call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
            if isinstance(stmt, ast.Assert):
                asserts = [(stmt, stmt.test)]
            elif call is not None and isinstance(call.func, ast.Name) and call.func.id in self.test_functions:
                asserts = self._inline(call, defined)
                if asserts is not None:
                    origin[len(checks)] = call.func.id
            else:
                steps.append(["exec", stmt])
                if isinstance(stmt, ast.FunctionDef):
                    defined.add(stmt.name)
                continue
            check, step = self._test(len(checks), stmt, asserts)
            checks.append(check)
            stmts.append(stmt)
            steps.append(step)
        steps, sent_defs = self._drop_inlined_defs(steps, set(origin.values()))
        checks = [_untrust(c) if origin.get(k) in sent_defs else c for k, c in enumerate(checks)]
        checks = self._not_sent(checks, stmts, steps)
        return TestPlan("assert", tuple(self._wire(s) for s in steps), tuple(checks))

    def _test(self, k: int, stmt: ast.stmt, asserts: list | None) -> tuple[_Check, list]:
        """(check, step) for test k: `asserts` are its (assert statement, condition) pairs, None
        when only the sandbox can run it."""
        src = _short(self.source(stmt))
        unsplit = _Check(None, 0, False, src), ["run", k, stmt]
        if asserts is None:
            return unsplit
        try:
            cutter = _Cutter(self)
            parts = [cutter.cut(test)[0] for _, test in asserts]
            pred = parts[0] if len(parts) == 1 else ast.BoolOp(ast.And(), parts)
            leaves = [ast.unparse(leaf) for leaf in cutter.leaves]
        except Exception:  # noqa: BLE001 - RecursionError on deep nesting, or a bug here: the sandbox runs it
            return unsplit
        return _Check(pred, len(leaves), cutter.trusted, src, self._redo(stmt, asserts)), ["eval", k, cutter.leaves, leaves]

    def _redo(self, stmt: ast.stmt, asserts: list) -> str | None:
        if isinstance(stmt, ast.Assert):
            return self.source(stmt)
        try:  # an inlined check(): its asserts with the parameter replaced
            return "\n".join(ast.unparse(ast.Assert(test, None)) for _, test in asserts)
        except RecursionError:
            return None

    def source(self, stmt: ast.stmt) -> str:
        """A statement's own text (not re-generated: unparse recurses, and may fail). What
        `ast.get_source_segment` gives, without splitting the whole text again at every call."""
        first, last = stmt.lineno - 1, stmt.end_lineno - 1  # columns count UTF-8 bytes
        if first == last:
            return self.lines[first][stmt.col_offset:stmt.end_col_offset].decode()
        parts = [self.lines[first][stmt.col_offset:], *self.lines[first + 1:last], self.lines[last][:stmt.end_col_offset]]
        return b"".join(parts).decode()

    def _not_sent(self, checks: list, stmts: list, steps: list) -> list:
        """Defensive check: a test stays trusted only if none of its asserts reaches the sandbox,
        neither as text (a string holding it) nor as the same condition inside a statement that
        is sent (the check() definition, a helper function repeating it)."""
        sent = [s[1] if s[0] == "exec" else s[2] for s in steps if s[0] != "eval"]
        text = "\n".join(self.source(node) for node in sent)
        conditions = {_dump(n.test) for node in sent for n in ast.walk(node) if isinstance(n, ast.Assert)}
        conditions.discard(None)

        def leaks(a: ast.Assert) -> bool:
            condition = _dump(a.test)
            return condition is None or condition in conditions or self.source(a) in text

        return [_untrust(c) if c.trusted and any(map(leaks, self._asserts_of(stmt))) else c
                for c, stmt in zip(checks, stmts)]

    def _asserts_of(self, stmt: ast.stmt) -> list[ast.Assert]:
        """The assert statements that hold a test's expected values: the assert itself, or the
        body of the check() it inlines."""
        if isinstance(stmt, ast.Assert):
            return [stmt]
        fn = self.defs.get(stmt.value.func.id)
        return [s for s in fn.body if isinstance(s, ast.Assert)] if fn else []

    def _wire(self, step: list) -> tuple:
        """A step as the JSON the sandbox gets (statements as their source text)."""
        if step[0] == "exec":
            return ("exec", self.source(step[1]))
        if step[0] == "run":
            return ("run", step[1], self.source(step[2]))
        return ("eval", step[1], tuple(step[3]))

    def _inline(self, call: ast.Call, defined: set[str]) -> list | None:
        """The asserts of `f(arg)` as (assert, condition) pairs, with f's parameter replaced by
        arg; None when f is not a one-parameter function of the tests, defined above, made of
        asserts only, or arg is not a plain name."""
        fn = self.defs.get(call.func.id) if isinstance(call.func, ast.Name) else None
        if fn is None or fn.name not in defined:
            return None
        if call.keywords or len(call.args) != 1 or not _is_dotted_name(call.args[0]):
            return None
        a = fn.args
        if fn.decorator_list or a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or len(a.args) != 1:
            return None
        body = [s for s in fn.body if not (isinstance(s, ast.Pass) or
                                           (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)))]
        if not body or not all(isinstance(s, ast.Assert) for s in body):
            return None
        param, arg = a.args[0].arg, call.args[0]
        try:
            return [(s, _Substitute(param, arg).visit(copy.deepcopy(s.test))) for s in body]
        except RecursionError:
            return None

    @staticmethod
    def _drop_inlined_defs(steps: list, inlined: set[str]) -> tuple[list, set[str]]:
        """Leave out the definitions of inlined test functions that nothing sent still uses;
        also returns the names of those that are sent all the same (`alias = check`): the
        tests inlined from them are not trusted, since their expected values reach the sandbox."""
        dropped = lambda s: s[0] == "exec" and isinstance(s[1], ast.FunctionDef) and s[1].name in inlined  # noqa: E731
        sent = [s[1] for s in steps if s[0] == "exec" and not dropped(s)]
        sent += [s[2] for s in steps if s[0] == "run"] + [leaf for s in steps if s[0] == "eval" for leaf in s[2]]
        used = {n.id for tree in sent for n in ast.walk(tree) if isinstance(n, ast.Name)}
        return [s for s in steps if not (dropped(s) and s[1].name not in used)], inlined & used


_LINES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _untrust(check: _Check) -> _Check:
    return _Check(check.pred, check.leaves, False, check.src, check.redo)


def _dump(node: ast.AST) -> str | None:
    try:
        return ast.dump(node)
    except RecursionError:
        return None


def _short(src: str, n: int = 80) -> str:
    src = " ".join(src.split())
    return src if len(src) <= n else src[: n - 3] + "..."


def _is_dotted_name(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


class _Substitute(ast.NodeTransformer):
    def __init__(self, name: str, value: ast.expr):
        self.name, self.value = name, value

    def visit_Name(self, node):
        return copy.deepcopy(self.value) if node.id == self.name else node


def _bindings(tree: ast.Module) -> dict[str, list[str]]:
    """Every name the tests bind anywhere, with how: "def", "import math" (`import math [as
    m]`), "from math.isclose" (`from math import *` gives "*" the kind "from math.*"), or "assign"."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, []).append("def")
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.setdefault(a.asname or a.name.split(".")[0], []).append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                out.setdefault(a.asname or a.name, []).append(f"from {node.module}.{a.name}")
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.setdefault(node.id, []).append("assign")
        elif isinstance(node, ast.arg):
            out.setdefault(node.arg, []).append("assign")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for n in node.names:
                out.setdefault(n, []).append("assign")
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            out.setdefault(node.name, []).append("assign")
        elif isinstance(node, ast.MatchMapping) and node.rest:
            out.setdefault(node.rest, []).append("assign")
    return out


# Functions the parent applies itself, by canonical name. With an argument that depends on the
# program they are the test's own tools (`abs(f(x) - 3) < 1e-6`, `sorted(f(x)) == [1, 2]`). With
# constant arguments, _FOLD functions give constants of the test (`float('inf')`, `set([1, 2])`,
# `math.sqrt(2)`), while _TOOLS stay in the sandbox (`max(3, 4) == 4` may be the program's `max`).
_MATH_FUNCS = ("isclose", "isinf", "isnan", "isfinite", "floor", "ceil", "sqrt", "fabs", "trunc")
_FOLD = {"float", "int", "str", "bool", "complex", "set", "frozenset", "list", "tuple", "type", "pow",
         "Decimal", "Fraction", *(f"math.{n}" for n in _MATH_FUNCS)}
_TOOLS = {"abs", "len", "sorted", "min", "max", "sum", "round", "all", "any", "isinstance"}
_ITERATING = {"list", "tuple", "set", "frozenset", "sorted", "sum", "min", "max", "all", "any"}
_KEYWORDS = {"sorted": {"reverse"}, "math.isclose": {"rel_tol", "abs_tol"}}
_MATH_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}
# (module, name) imported by the tests -> canonical name / constant
_IMPORTED = {("decimal", "Decimal"): "Decimal", ("fractions", "Fraction"): "Fraction",
             **{("math", n): f"math.{n}" for n in _MATH_FUNCS}}
_TYPES = {t.__name__: t for t in (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset)}
_BUILTIN_NAMES = frozenset(dir(builtins))
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift,
           ast.BitOr, ast.BitXor, ast.BitAnd)


class _Cutter:
    """Cut an assert's condition into a predicate the parent evaluates (`_teval`) and "leaves"
    the sandbox evaluates: every sub-expression outside a small grammar (constants, displays,
    `not`/`-`, arithmetic, `and`/`or`, comparisons, the builtins above, builtin type names) is
    a leaf, e.g. `add(1, 2)`, `x`, `f(x)[0]`. Constant sub-expressions are folded here, so the
    sandbox never sees them. `trusted` drops to False as soon as one leaf is not the program's
    own output (`_AssertPlanner.owned`)."""

    def __init__(self, planner: _AssertPlanner):
        self.p, self.leaves, self.trusted = planner, [], True

    def cut(self, node: ast.expr) -> tuple[ast.expr, bool]:
        """(node for the parent, whether it depends on a leaf)."""
        new, tainted = self._cut(node)
        if tainted or isinstance(new, ast.Constant):
            return new, tainted
        try:  # a constant: fold it now; what the parent may not compute stays in the sandbox
            return ast.Constant(_teval(new, _no_leaves)), False
        except Exception:  # noqa: BLE001
            return self._leaf(node), True

    def _cut(self, node: ast.expr) -> tuple[ast.expr, bool]:
        p = self.p
        if isinstance(node, ast.Constant):
            return node, False
        if isinstance(node, ast.Name) and node.id in _TYPES and node.id not in p.bound and not p.star:
            return ast.Constant(_TYPES[node.id]), False  # `type(f(x)) is list`
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            elts, t = self._all(node.elts)
            return (ast.Set(elts) if isinstance(node, ast.Set) else type(node)(elts, ast.Load())), any(t)
        if isinstance(node, ast.Dict) and None not in node.keys:
            keys, tk = self._all(node.keys)
            values, tv = self._all(node.values)
            return ast.Dict(keys, values), any(tk + tv)
        if isinstance(node, ast.UnaryOp):
            operand, t = self.cut(node.operand)
            return ast.UnaryOp(node.op, operand), t
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
            (left, tl), (right, tr) = self.cut(node.left), self.cut(node.right)
            return ast.BinOp(left, node.op, right), tl or tr
        if isinstance(node, ast.BoolOp):
            values, t = self._all(node.values)
            return ast.BoolOp(node.op, values), any(t)
        if isinstance(node, ast.Compare):
            parts, t = self._all([node.left, *node.comparators])
            return ast.Compare(parts[0], node.ops, parts[1:]), any(t)
        imported = p.imported(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if imported and imported[0] == "math" and imported[1] in _MATH_CONSTANTS:
            return ast.Constant(_MATH_CONSTANTS[imported[1]]), False  # math.pi
        if isinstance(node, ast.Call):
            name = self._builtin(node)
            if name is not None and (name in _FOLD or self._depends(node)):
                args, t = self._all(node.args)
                if name in _ITERATING and t and t[0] and (name not in ("min", "max") or len(args) == 1):
                    self._materialize(args[0])
                kws, tk = self._all([k.value for k in node.keywords])
                keywords = [ast.keyword(k.arg, v) for k, v in zip(node.keywords, kws)]
                return ast.Call(ast.Name(name, ast.Load()), args, keywords), any(t + tk)
        return self._leaf(node), True

    def _all(self, nodes: list) -> tuple[list, list[bool]]:
        out = [self.cut(n) for n in nodes]
        return [n for n, _ in out], [t for _, t in out]

    def _leaf(self, node: ast.expr) -> ast.Name:
        self.trusted &= self.p.owned(node)
        self.leaves.append(node)
        return ast.Name(f"#{len(self.leaves) - 1}", ast.Load())  # '#' cannot occur in real names

    def _materialize(self, arg: ast.expr) -> None:
        """A leaf the parent will iterate over is sent as `[*leaf]`: the program's own iteration,
        as a list (a generator cannot travel; `list(gen())` still works)."""
        if isinstance(arg, ast.Name) and arg.id.startswith("#"):
            k = int(arg.id[1:])
            self.leaves[k] = ast.List([ast.Starred(self.leaves[k], ast.Load())], ast.Load())

    def _depends(self, call: ast.Call) -> bool:
        """Whether some argument needs the sandbox (checked on a throwaway cutter). Memoised per
        node: without it nested calls (`abs(abs(abs(...)))`) cost 2**depth."""
        memo = self.p.depends
        if call not in memo:
            probe = _Cutter(self.p)
            memo[call] = any(probe.cut(a)[1] for a in [*call.args, *(k.value for k in call.keywords)])
        return memo[call]

    def _builtin(self, call: ast.Call) -> str | None:
        """The canonical name of the parent-side function `call` uses, or None. A name the tests
        bind themselves is theirs; `math.sqrt`, `Decimal`, ... count only when the tests import
        them. The program's own definitions do not count: here `abs` always means the builtin,
        so a program cannot swap in an `abs` that makes every difference small."""
        p, f = self.p, call.func
        if any(isinstance(a, ast.Starred) for a in call.args):
            return None
        if isinstance(f, ast.Name) and f.id in _FOLD | _TOOLS and f.id not in p.bound and not p.star:
            name = f.id
        else:
            name = _IMPORTED.get(p.imported(f) or ("", ""))
        if name is None or not all(k.arg in _KEYWORDS.get(name, ()) for k in call.keywords):
            return None
        return name


def _no_leaves(k: int):
    raise ValueError("a constant has no leaves")
