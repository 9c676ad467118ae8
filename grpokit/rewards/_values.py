"""Trusted side of the code sandbox, part 2: plain values and bounded evaluation on them.

The sandbox only ever returns data: tagged JSON of plain builtin values, rebuilt here by
`decode_value` with depth and size limits. `_teval` evaluates a test's predicate on such values in
the trainer. A hostile program chooses the values, so every operation is bounded: nothing it sends
may cost the trainer more than a bounded amount of time or memory.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction

# ------------------------------------------------------------------ evaluating on plain data
# Runs in the trainer on values the program chose, so every operation is bounded: numbers past
# _INT_BITS, or results past _SEQ_MAX elements, are refused (the test then fails).

_INT_BITS = 2**17
_FRACTION_BITS = 2**12  # Fraction arithmetic runs a gcd at every step: much slower per bit
_JSON_SCALARS = {type(None), bool, int, float, str}
_SEQ_MAX = 10**6
_NUMBERS = (bool, int, float, complex, Fraction, Decimal)
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
          ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b, ast.Is: lambda a, b: _same(a, b),
            ast.IsNot: lambda a, b: not _same(a, b)}


class _LeafError(Exception):
    """The sandbox could not give a leaf's value (it raised, or was too large to send)."""


class _NotPlain(_LeafError):
    """The leaf's value is not plain data (the program's own class, a dict view, ...): only the
    sandbox can judge the test, by running its original assert (`_judge.py`)."""


def _teval(node: ast.expr, leaf):
    """Evaluate a `_Cutter` predicate; `leaf(k)` gives the value of leaf k."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return leaf(int(node.id[1:]))
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](_teval(e, leaf) for e in node.elts)
    if isinstance(node, ast.Dict):
        return {_teval(k, leaf): _teval(v, leaf) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        v = _teval(node.operand, leaf)
        if isinstance(node.op, ast.Not):
            return not v
        return {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}[type(node.op)](_num(v))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _teval(node.left, leaf), _teval(node.right, leaf))
    if isinstance(node, ast.BoolOp):  # short-circuits: a leaf that raised only matters if needed
        for value in node.values:
            v = _teval(value, leaf)
            if (not v) if isinstance(node.op, ast.And) else v:
                return v
        return v
    if isinstance(node, ast.Compare):
        left = _teval(node.left, leaf)
        for op, comp in zip(node.ops, node.comparators):
            right = _teval(comp, leaf)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call):
        args = [_teval(a, leaf) for a in node.args]
        return _call(node.func.id, args, {k.arg: _teval(k.value, leaf) for k in node.keywords})
    raise TypeError(f"cannot evaluate {type(node).__name__}")


def _num(x):
    """`x` if it is a number small enough to compute with here."""
    if type(x) not in _NUMBERS:
        raise TypeError(f"{type(x).__name__} is not a number")
    limit = _FRACTION_BITS if type(x) is Fraction else _INT_BITS
    if _bits(x) > limit or (type(x) is Decimal and x.is_finite() and abs(x.adjusted()) > 10_000):
        raise ValueError("number too large to compute with here")
    return x


def _plain_items(items: list) -> bool:
    """All of `items` are JSON scalars, which need no rebuilding (checked in C: fast)."""
    return set(map(type, items)) <= _JSON_SCALARS


def _bits(x) -> int:
    if type(x) is Fraction:
        return max(x.numerator.bit_length(), x.denominator.bit_length())
    return x.bit_length() if type(x) in (int, bool) else 0


def _binop(op: ast.operator, a, b):
    if isinstance(op, ast.Add) and type(a) is type(b) and type(a) in (str, bytes, list, tuple):
        return _sized(a + b)
    if isinstance(op, ast.Mult) and {type(a), type(b)} & {str, bytes, list, tuple}:
        seq, n = (a, b) if type(b) is int else (b, a)
        if type(n) is not int or len(seq) * max(n, 0) > _SEQ_MAX:
            raise ValueError("sequence repetition too large")
        return seq * n
    sets = (set, frozenset)
    if isinstance(op, (ast.Sub, ast.BitOr, ast.BitAnd, ast.BitXor)) and type(a) in sets and type(b) in sets:
        return _ARITH[type(op)](a, b)
    a, b = _num(a), _num(b)
    if isinstance(op, ast.Pow) and type(a) in (int, bool, Fraction) and type(b) in (int, bool):
        if _bits(a) * abs(b) > _INT_BITS:  # exact powers grow; float/Decimal ones overflow instead
            raise ValueError("power too large")
    if isinstance(op, ast.LShift) and type(b) is int and b > _INT_BITS:
        raise ValueError("shift too large")
    return _ARITH[type(op)](a, b)


def _sized(x):
    if len(x) > _SEQ_MAX:
        raise ValueError("result too large")
    return x


def _same(a, b) -> bool:
    """`is` on rebuilt values: for numbers, strings and bytes "same type and equal" (what
    `f(x) is 3` gives in CPython for the small values tests use), else identity (None, True,
    False, types; a rebuilt list is never the same object as anything)."""
    if type(a) in (int, float, complex, str, bytes):
        return type(a) is type(b) and a == b
    return a is b


_PLAIN = {"float": float, "int": int, "str": str, "bool": bool, "complex": complex, "set": set,
          "frozenset": frozenset, "list": list, "tuple": tuple, "type": type, "isinstance": isinstance,
          "len": len, "sorted": sorted, "min": min, "max": max, "all": all, "any": any}


def _call(name: str, args: list, kwargs: dict):
    """Apply a parent-side function to rebuilt values, with the size guards above."""
    if name.startswith("math.") or name in ("abs", "round", "pow"):
        args, kwargs = [_num(a) for a in args], {k: _num(v) for k, v in kwargs.items()}
        if name == "pow":
            return _pow(*args)
        if name == "round" and len(args) > 1 and (type(args[1]) is not int or abs(args[1]) > 1000):
            raise ValueError("round: ndigits must be a small int")
        fn = getattr(math, name[5:]) if name.startswith("math.") else {"abs": abs, "round": round}[name]
        return fn(*args, **kwargs)
    if name == "sum":  # the running total is checked too: Fractions can grow at every step
        total = _num(args[1]) if len(args) > 1 else 0
        for x in args[0]:
            total = _num(total + _num(x))
        return total
    if name in ("set", "frozenset") and args:
        args = [_hash_safe(list(args[0]))]
    if name in _CONVERTERS:  # Fraction(Decimal('1e10000000')), int('9' * 10**6): hours of CPU
        args = [_convertible(a) for a in args]
        if name in ("Decimal", "Fraction"):
            return _num((Decimal if name == "Decimal" else Fraction)(*args))
    if name == "str" and args:
        _printable(args[0])
    return _sized_result(_PLAIN[name](*args, **kwargs))


_CONVERTERS = {"Decimal", "Fraction", "int", "float", "complex"}
_TEXT_MAX = 4300  # characters of a number's text (CPython's own default limit for int(str))
_EXPONENT = re.compile(r"[eE]\s*[+-]?\s*([0-9_]+)")


def _convertible(x):
    """`x` if a number constructor may take it: a number small enough to compute with, or text
    that is short and has no huge exponent (`Fraction('1e10000000')` builds 10**10000000)."""
    if type(x) in _NUMBERS:
        return _num(x)
    if type(x) in (str, bytes):
        text = x if type(x) is str else x.decode("latin-1")
        if len(text) > _TEXT_MAX:
            raise ValueError("number text too long to convert here")
        for digits in _EXPONENT.findall(text):
            digits = digits.replace("_", "").lstrip("0")
            if len(digits) > 5 or int(digits or 0) > 10_000:
                raise ValueError("exponent too large to convert here")
    return x


def _printable(x) -> None:
    """Refuse to print a value holding a huge number: int-to-decimal text is quadratic (with
    CPython's digit limit lifted, str() of a 2**22-bit integer takes half a minute)."""
    stack, seen = [x], 0
    while stack:
        v = stack.pop()
        seen += 1
        if type(v) in (int, Fraction):
            _num(v)
        elif type(v) in (list, tuple, set, frozenset):
            stack.extend(v)
        elif type(v) is dict:
            stack.extend(v.keys())
            stack.extend(v.values())
        if seen > _SEQ_MAX:
            raise ValueError("value too large to print here")


def _pow(a, b, m=None):
    if m is None:
        return _binop(ast.Pow(), a, b)
    if _bits(b) * max(_bits(m), 64) > 2**22:  # modular: cost grows with exponent x modulus size
        raise ValueError("pow too large")
    return pow(a, b, m)


def _sized_result(x):
    return _sized(x) if type(x) in (str, list, tuple, set, frozenset) else x


def _hash_safe(items: list) -> list:
    """`items`, refused when a set or dict of them would take quadratic time to build: unequal
    values with one hash (easy to make with big ints, `k * (2**61 - 1)`) all share one slot.
    Equal values are fine (they are found at once), so only crowded hashes are looked at."""
    hashes = list(map(hash, items))
    crowded = {h for h, n in Counter(hashes).items() if n > 64}
    if crowded:
        first: dict[int, object] = {}
        unequal = Counter()
        for x, h in zip(items, hashes):
            if h in crowded and not x == first.setdefault(h, x):
                unequal[h] += 1
        if unequal and max(unequal.values()) > 64:
            raise ValueError("too many unequal values with one hash")
    return items


_HEX = re.compile(r"-?[0-9a-f]+")


def decode_value(x, depth: int = 0):
    """Rebuild a value the harness sent (`_sandbox_launcher.encode_value` is the inverse). Only
    plain builtin values (and stdlib Fraction/Decimal, compared by the parent's own classes) can
    come out; anything else raises ValueError, an error marker ("!") _LeafError, and the marker
    of a value that is not plain data ("?") _NotPlain."""
    if depth > 100:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None or t in (bool, int, float, str):  # all json.loads can produce besides list/dict
        return x
    if t is list:
        return x if _plain_items(x) else [decode_value(v, depth + 1) for v in x]
    if t is not dict or len(x) != 1:
        raise ValueError("not an encoded value")
    ((tag, v),) = x.items()
    if tag == "!":
        raise _LeafError(str(v)[:200])
    if tag == "i" and type(v) is str and _HEX.fullmatch(v):
        return int(v, 16)
    if tag in ("t", "S", "F") and type(v) is list:
        items = decode_value(v, depth)  # as a list
        return tuple(items) if tag == "t" else (set if tag == "S" else frozenset)(_hash_safe(items))
    if tag == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        keys = _hash_safe([decode_value(k, depth + 1) for k, _ in v])
        return dict(zip(keys, (decode_value(w, depth + 1) for _, w in v)))
    if tag == "c" and type(v) is list and len(v) == 2 and all(type(p) in (int, float) for p in v):
        return complex(v[0], v[1])
    if tag == "y" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "q" and type(v) is list and len(v) == 2:
        num, den = (decode_value(e, depth + 1) for e in v)
        if type(num) is int and type(den) is int and den:  # bounded before Fraction's gcd runs
            return Fraction(_num(Fraction(num)), _num(Fraction(den)))
    if tag == "D" and type(v) is str and len(v) <= 1000:
        return Decimal(v)  # text is cheap to compare; conversions and arithmetic go through _num
    if tag == "?":
        raise _NotPlain(str(v)[:200])
    raise ValueError(f"not an encoded value (tag {str(tag)[:20]!r})")
