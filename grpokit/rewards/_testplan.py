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
import json
import math
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
    """

    pred: ast.expr | None
    leaves: int
    trusted: bool
    src: str  # the test's source, shortened, for CodeResult.detail


@dataclass(frozen=True)
class TestPlan:
    __test__ = False  # not a pytest test class

    mode: str  # "assert" | "io"
    steps: list  # what the sandbox runs (JSON): assert steps, or the stdin of each io case
    checks: list  # assert: one _Check per test; io: the expected stdout of each case

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def untrusted(self) -> int:
        return sum(1 for c in self.checks if isinstance(c, _Check) and not c.trusted)


def plan_tests(tests) -> TestPlan:
    """The plan for `tests` (an assert script or stdin/stdout cases); ValueError if unusable."""
    cases = parse_io_tests(tests)
    if cases is not None:
        return TestPlan("io", [i for i, _ in cases], [o for _, o in cases])
    if not isinstance(tests, str):
        raise ValueError(f"tests must be a Python script or stdin/stdout cases, got {type(tests).__name__}")
    try:
        tree = ast.parse(tests, "<tests>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"tests do not parse: {e}") from None
    return _AssertPlanner(tree).plan()


class _AssertPlanner:
    """Every top-level `assert` is one test, and so is every top-level call (HumanEval's
    `check(candidate)`); all other statements are setup, run in order in the sandbox.

    An assert becomes an "eval" step: the sandbox evaluates its leaves (see `_Cutter`) at the
    assert's place in the sequence and sends their values. A call of a test function whose body
    is only asserts (`def check(candidate): assert candidate(1) == 2 ...`) is inlined the same
    way, and the function's definition is then not sent at all (its constants are the expected
    values). Any other call becomes a "run" step whose verdict comes from the sandbox.
    """

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.bound = _bindings(tree)
        self.star = any(k.endswith(".*") for kinds in self.bound.values() for k in kinds)
        self.defs = {s.name: s for s in tree.body
                     if isinstance(s, ast.FunctionDef) and self.bound.get(s.name) == ["def"]}
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
        steps, checks, inlined, defined = [], [], set(), set()
        for stmt in self.tree.body:
            if isinstance(stmt, ast.Assert):
                asserts = [stmt.test]
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                asserts = self._inline(stmt.value, defined)
                if asserts is not None:
                    inlined.add(stmt.value.func.id)
            else:
                steps.append(["exec", stmt])
                if isinstance(stmt, ast.FunctionDef):
                    defined.add(stmt.name)
                continue
            k, src = len(checks), _short(ast.unparse(stmt))
            if asserts is None:
                checks.append(_Check(None, 0, False, src))
                steps.append(["run", k, stmt])
                continue
            cutter = _Cutter(self)
            parts = [cutter.cut(e)[0] for e in asserts]
            pred = parts[0] if len(parts) == 1 else ast.BoolOp(ast.And(), parts)
            checks.append(_Check(pred, len(cutter.leaves), cutter.trusted, src))
            steps.append(["eval", k, cutter.leaves])
        steps = self._drop_inlined_defs(steps, inlined)
        return TestPlan("assert", [_unparse_step(s) for s in steps], checks)

    def _inline(self, call: ast.Call, defined: set[str]) -> list[ast.expr] | None:
        """The asserts of `f(arg)`, with f's parameter replaced by arg; None when f is not a
        one-parameter function of the tests, defined above, made of asserts only, or arg is not
        a plain name."""
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
        return [_Substitute(param, arg).visit(copy.deepcopy(s.test)) for s in body]

    @staticmethod
    def _drop_inlined_defs(steps: list, inlined: set[str]) -> list:
        """Leave out the definitions of inlined test functions that nothing sent still uses."""
        dropped = lambda s: s[0] == "exec" and isinstance(s[1], ast.FunctionDef) and s[1].name in inlined  # noqa: E731
        sent = [s[1] for s in steps if s[0] == "exec" and not dropped(s)]
        sent += [s[2] for s in steps if s[0] == "run"] + [leaf for s in steps if s[0] == "eval" for leaf in s[2]]
        used = {n.id for tree in sent for n in ast.walk(tree) if isinstance(n, ast.Name)}
        return [s for s in steps if not (dropped(s) and s[1].name not in used)]


def _unparse_step(step: list) -> list:
    if step[0] == "exec":
        return ["exec", ast.unparse(step[1])]
    if step[0] == "run":
        return ["run", step[1], ast.unparse(step[2])]
    return ["eval", step[1], [ast.unparse(leaf) for leaf in step[2]]]


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
        """Whether some argument needs the sandbox (checked on a throwaway cutter)."""
        probe = _Cutter(self.p)
        return any(probe.cut(a)[1] for a in [*call.args, *(k.value for k in call.keywords)])

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
