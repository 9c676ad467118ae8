"""The independent second math checker (`math_accuracy_alt`): its own extraction and its own
equivalence, sharing no code with the primary path (`_mathcore.py` + math-verify).

- Extraction: only the *last* box (no hedging rule), else the last line that states an answer,
  else the last number of the text's last line. Written differently on purpose: a bug in one
  extractor then shows up as a disagreement instead of being copied.
- Equivalence: a small LaTeX -> Python-expression translator, sympy's `parse_expr` on a
  whitelisted token set (it evaluates its input, so nothing else may reach it), then numeric
  comparison (relative 1e-6) or, for expressions with symbols, `expand(a - b) == 0` and agreement
  at random points. Tuples / intervals keep order and bracket type; sets and bare lists do not.

Runs inside the math worker process (time limit, memory limit); stdlib + sympy only.
"""

from __future__ import annotations

import random
import re

# --------------------------------------------------------------------------- extraction


def _last_box(text: str) -> str | None:
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    j = text.find("{", at)
    if j < 0 or text[at:j].strip("\\boxedfbx ") != "":
        return None
    depth, k = 0, j
    while k < len(text):
        ch = text[k]
        if ch == "\\":
            k += 2
            continue
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return text[j + 1 : k].strip()
        k += 1
    return None


def extract_alt(text: str) -> str | None:
    box = _last_box(text)
    if box:
        return box
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        low = ln.lower()
        if ln.startswith("####"):
            return ln[4:].strip() or None
        k = max(low.rfind("answer:"), low.rfind("answer is"))
        if k >= 0:
            rest = ln[k + len("answer") :].lstrip(" :")
            rest = rest[2:] if rest.lower().startswith("is") else rest
            rest = rest.strip().strip("*").strip()
            if "$" in rest:
                parts = rest.split("$")
                rest = parts[1] if len(parts) > 2 else rest.replace("$", "")
            rest = rest.split(". ")[0].rstrip(".").strip()
            return rest or None
    if lines:
        nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", lines[-1][-2000:])
        nums = [x.rstrip(",") for x in nums]
        if nums:
            return nums[-1].replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", nums[-1]) else nums[-1]
    return None


# --------------------------------------------------------------------------- normalisation

_UNITS_TEXT = re.compile(r"\\(?:text|mbox|mathrm|textbf|mathbf)\s*\{([^{}]*)\}")


def _strip(s: str) -> tuple[str, bool]:
    """Return (cleaned, was_percent)."""
    s = s.strip().strip("$").strip()
    for a, b in (("\u2212", "-"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
                 ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("{,}", ""), ("\\displaystyle", "")):
        s = s.replace(a, b)
    s = re.sub(r"\^\s*\{?\\circ\}?|\u00b0|\\degree", "", s)
    pct = bool(re.search(r"\\?%\s*$", s))
    s = re.sub(r"\\?%\s*$", "", s)
    # units and words in \text{...}: drop them after a number, unwrap them otherwise
    s = re.sub(r"(?<=[\d}])\s*" + _UNITS_TEXT.pattern + r"\s*$", "", s)
    s = _UNITS_TEXT.sub(lambda m: m.group(1), s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s) if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(.+)", s)  # "x = 3" -> "3"
    if m and "=" not in m.group(1):
        s = m.group(1)
    return s.strip().rstrip("."), pct


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _structure(s: str):
    """("set", [elems]) | ("seq", "(]", [elems]) | ("scalar", s)."""
    if s.startswith("\\{") and s.endswith("\\}"):
        return ("set", _split_top(s[2:-2]))
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
        depth = 0
        for ch in inner:  # "(a)(b)" is not one bracketed group
            depth += (ch in "([{") - (ch in ")]}")
            if depth < 0:
                break
        else:
            parts = _split_top(inner)
            if len(parts) > 1:
                return ("seq", s[0] + s[-1], parts)
    parts = _split_top(s)
    if len(parts) > 1:
        return ("set", parts)
    return ("scalar", s)


# --------------------------------------------------------------------------- LaTeX -> sympy

_FUNCS = {"sqrt", "pi", "oo", "log", "ln", "sin", "cos", "tan", "exp", "E", "I", "Abs"}
_SIMPLE = [
    (r"\\cdot|\\times", "*"), (r"\\div", "/"), (r"\\pi", " pi "), (r"\\infty", " oo "),
    (r"\\ln", " log"), (r"\\log", " log"), (r"\\sin", " sin"), (r"\\cos", " cos"), (r"\\tan", " tan"),
    (r"\\exp", " exp"), (r"\\mid|\\vert|\|", "|"),
]


def _group(s: str, i: int) -> tuple[str, int]:
    """The braced group starting at s[i] == "{", or the single next token; returns (body, end)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        depth = 0
        for k in range(i, len(s)):
            depth += (s[k] == "{") - (s[k] == "}")
            if depth == 0:
                return s[i + 1 : k], k + 1
        raise ValueError("unbalanced braces")
    if i < len(s):
        return s[i], i + 1
    raise ValueError("missing argument")


def _latex_to_py(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            a, i = _group(s, i + 5)
            b, i = _group(s, i)
            out.append(f"(({_latex_to_py(a)})/({_latex_to_py(b)}))")
        elif s.startswith("\\sqrt", i):
            j = i + 5
            if j < len(s) and s[j] == "[":
                k = s.index("]", j)
                n = s[j + 1 : k]
                a, i = _group(s, k + 1)
                out.append(f"(({_latex_to_py(a)})**(1/({_latex_to_py(n)})))")
            else:
                a, i = _group(s, j)
                out.append(f"sqrt({_latex_to_py(a)})")
        elif s[i] == "^":
            a, i = _group(s, i + 1)
            out.append(f"**({_latex_to_py(a)})")
        elif s[i] in "{}":
            out.append("(" if s[i] == "{" else ")")
            i += 1
        else:
            out.append(s[i])
            i += 1
    py = "".join(out)
    for pat, rep in _SIMPLE:
        py = re.sub(pat, rep, py)
    return py


def _to_sympy(s: str):
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    py = _latex_to_py(s)
    py = re.sub(r"\|([^|]+)\|", r"Abs(\1)", py)
    if not re.fullmatch(r"[0-9A-Za-z_.+\-*/() ]*", py) or "__" in py or re.search(r"(?<!\d)\.|\.(?!\d)", py):
        raise ValueError("outside the whitelisted grammar")
    names = set(re.findall(r"[A-Za-z_]\w*", py))
    if any(len(n) > 1 and n not in _FUNCS for n in names):
        raise ValueError("unknown name")
    local = {n: sympy.Symbol(n) for n in names if len(n) == 1 and n not in ("E", "I")}
    local["e"] = sympy.E
    glob = {"sqrt": sympy.sqrt, "pi": sympy.pi, "oo": sympy.oo, "log": sympy.log, "ln": sympy.log,
            "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "exp": sympy.exp, "E": sympy.E, "I": sympy.I,
            "Abs": sympy.Abs, "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
            "Symbol": sympy.Symbol}
    tr = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr(py, local_dict=local, global_dict=glob, transformations=tr)


def _scalar_equal(a: str, b: str) -> bool:
    import sympy

    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    try:
        x, y = _to_sympy(a), _to_sympy(b)
    except Exception:  # noqa: BLE001 - not an expression we can read: only identical text counts
        return False
    if x.free_symbols != y.free_symbols:
        return False
    if not x.free_symbols:
        try:
            vx, vy = complex(sympy.N(x, 30)), complex(sympy.N(y, 30))
        except (TypeError, ValueError):
            return x == y
        if vx == vy:
            return True
        return abs(vx - vy) <= 1e-6 * max(1.0, abs(vy))
    d = x - y
    if sympy.expand(d) == 0:
        return True
    rng = random.Random(0)
    syms = sorted(x.free_symbols, key=str)
    for _ in range(5):
        pt = {s: sympy.Rational(rng.randint(1, 97), rng.randint(1, 13)) for s in syms}
        try:
            v = complex(sympy.N(d.subs(pt), 30))
        except (TypeError, ValueError, ZeroDivisionError):
            return False
        if abs(v) > 1e-8:
            return False
    return True


def _equal(a: str, b: str) -> bool:
    (sa, pa), (sb, pb) = _strip(a), _strip(b)
    ta, tb = _structure(sa), _structure(sb)
    if ta[0] == "scalar" and tb[0] == "scalar":
        if _scalar_equal(sa, sb):
            return True
        if pa != pb:  # "50%" against "0.5"
            pct, other = (sa, sb) if pa else (sb, sa)
            return _scalar_equal(f"({pct})/100", other)
        return False
    if ta[0] != tb[0]:
        return False
    if ta[0] == "seq":
        return ta[1] == tb[1] and len(ta[2]) == len(tb[2]) and all(_equal(x, y) for x, y in zip(ta[2], tb[2]))
    xs, ys = list(ta[1]), list(tb[1])  # sets: a perfect matching under element equality
    if len(xs) != len(ys):
        return False
    for x in xs:
        for k, y in enumerate(ys):
            if _equal(x, y):
                del ys[k]
                break
        else:
            return False
    return True


def equal_alt(pred: str, ref: str) -> bool:
    if not pred or not ref:
        return False
    return _equal(pred, ref)


def _as_number(s: str) -> str | None:
    """"int", "real" or "ratio" when `s`, stripped, is one number written out; else None."""
    t, _ = _strip(s)
    t = re.sub(r"\\frac\s*\{\s*([+-]?\d+)\s*\}\s*\{\s*([+-]?\d+)\s*\}", r"\1/\2", t.replace("$", "").strip())
    t = re.sub(r"(?<=\d)\s+[A-Za-z]+$", "", t).replace(" ", "")
    while t[:1] == "{" and t[-1:] == "}":
        t = t[1:-1]
    if re.fullmatch(r"[+-]?\d+", t):
        return "int"
    if re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", t):
        return "real"
    return "ratio" if re.fullmatch(r"[+-]?\d+/[+-]?\d+", t) else None


def unevaluated_alt(pred: str, ref: str) -> bool:
    """The reference is one number and the answer is not written as one; an integer reference
    takes no fraction (this checker's own reading of `strict_numbers`)."""
    want = _as_number(ref)
    if want is None:
        return False
    got = _as_number(pred)
    return got is None or (got == "ratio" and want == "int")


def reference_alt(ref) -> str:
    s = str(ref).strip()
    if "####" in s:
        s = s.split("####")[-1]
    return (_last_box(s) or s).strip().strip("$").strip()
