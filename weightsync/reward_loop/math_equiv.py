"""Whether two math answers are the same value: the grader behind the numina (PRIME) and geo3k
rules. ``equivalent(given, truth)`` is true when the answers (1) normalise to one spelling
(``score_math.normalize_math``), or (2) after answer-level clean-up (units, ``\\text{}``,
thousands commas, mixed numbers, ``or``/``and`` lists, case) are one string, or (3) element by
element, for tuples, intervals and matrices (``pmatrix`` equals ``bmatrix``), are one value
under sympy: LaTeX is turned into a sympy expression by our own small translator (fractions,
roots, powers, ``\\pi``, ``\\cdot``, implicit products) and they must have the same value
(numbers) or agree at three fixed points of their unknowns (expressions; ``simplify`` is never
called, it can run for minutes). The strict mode (``tolerance=None``, the PRM800K grader's rules that geo3k's checker
follows) refuses sympy when the truth is an integer and the answer is not, and compares
unreduced fractions as written; the lenient mode (a relative ``tolerance``, PRIME's
``math_equal``) also takes a number within the tolerance of the truth, of the truth / 100 or of
the truth * 100 (a percentage). Expressions sympy might hang on (more than two unknowns, large
or stacked exponents, long text) are not evaluated: such answers match only as strings. sympy is
imported on first use.
"""

from __future__ import annotations

import math
import re

from weightsync.reward_loop.score_math import normalize_math

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day",
          "week", "month", "year", "foot", "feet", "inch", "yard", "liter")
_FUNCTIONS = {"sqrt", "pi", "oo", "log", "ln", "exp", "sin", "cos", "tan", "E", "I"}
_LATEX_WORDS = {"\\pi": " pi ", "\\infty": " oo ", "\\cdot": "*", "\\times": "*", "\\div": "/",
                "\\ln": " log", "\\log": " log", "\\exp": " exp", "\\sin": " sin",
                "\\cos": " cos", "\\tan": " tan", "\\le": "<=", "\\ge": ">="}
_MAX_EVAL_CHARS = 200
# values for the (at most two) unknowns at which two expressions must agree
_PROBES = ((1.2345, 0.6789), (2.7183, -1.4142), (-0.5772, 3.1416))
_MATRIX = re.compile(r"\\begin\{[pbvBV]?matrix\}(.*?)\\end\{[pbvBV]?matrix\}", re.DOTALL)


def _group(s: str, i: int) -> tuple[str, int] | None:
    """The balanced ``{...}`` (or one character) at ``s[i]``: (content, index after it)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    return None


def _expand_commands(s: str) -> str | None:
    """``\\frac{a}{b}`` -> ``((a)/(b))``, ``\\sqrt[n]{x}`` -> ``((x)**(1/(n)))``,
    ``\\sqrt{x}`` -> ``sqrt(x)``, innermost first; None when an argument is missing."""
    out, i = [], 0
    while i < len(s):
        m = re.match(r"\\[dt]?frac|\\sqrt", s[i:])
        if not m:
            out.append(s[i])
            i += 1
            continue
        i += m.end()
        root = None
        if m.group() == "\\sqrt" and i < len(s) and s[i] == "[":
            close = s.find("]", i)
            if close < 0:
                return None
            root, i = s[i + 1:close], close + 1
        first = _group(s, i)
        if first is None:
            return None
        a, i = first
        a = _expand_commands(a)
        if a is None:
            return None
        if m.group() == "\\sqrt":
            out.append(f"(({a})**(1/({root})))" if root else f"sqrt({a})")
            continue
        second = _group(s, i)
        if second is None:
            return None
        b, i = second
        b = _expand_commands(b)
        if b is None:
            return None
        out.append(f"(({a})/({b}))")
    return "".join(out)


def latex_to_sympy(expr: str):  # -> sympy.Expr | None
    """``expr`` (LaTeX or plain) as a sympy expression, or None when it cannot be read safely.

    Args:
        expr: one answer, normalised or not.

    Returns:
        The expression, or None: unknown commands or words, more than two unknowns, an exponent
        of three digits or more, a power tower, more than 200 characters, or a parse error.
    """
    s = expr.strip()
    if not s or len(s) > _MAX_EVAL_CHARS:
        return None
    for old in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$"):
        s = s.replace(old, "")
    s = _expand_commands(s)
    if s is None:
        return None
    for word, new in _LATEX_WORDS.items():
        s = re.sub(re.escape(word) + r"(?![a-zA-Z])", new, s)
    if "\\" in s or "_" in s:
        return None
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    words = set(re.findall(r"[A-Za-z]+", s))
    letters = {w for w in words if len(w) == 1 and w not in _FUNCTIONS}
    if any(len(w) > 1 and w not in _FUNCTIONS for w in words) or len(letters) > 2:
        return None
    if re.search(r"\*\*\s*\(?\s*-?\d{3,}", s) or re.search(r"\*\*\s*(\w+|\([^()]*\))\s*\*\*|\*\*\s*\([^()]*\*\*", s):
        return None
    if not re.fullmatch(r"[\w\s+\-*/().]*", s):
        return None
    from sympy import E, I, Symbol, log, oo, pi, sqrt
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    names = {"pi": pi, "oo": oo, "sqrt": sqrt, "log": log, "ln": log, "E": E, "I": I}
    names.update({w: Symbol(w) for w in letters})
    try:
        return parse_expr(s, local_dict=names, evaluate=True, transformations=(
            *standard_transformations, implicit_multiplication_application))
    except Exception:  # any parse failure means "not readable", never a crash of the reward
        return None


def _clean(answer: str) -> str:
    """Answer-level clean-up before comparing strings or splitting tuples."""
    s = answer.strip()
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    if m:
        s = m.group(1)
    for old, new in (("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""), (" or ", " , "),
                     (" and ", " , "), ("million", "*10^6"), ("billion", "*10^9")):
        s = s.replace(old, new)
    for unit in _UNITS:
        s = re.sub(unit + r"(es)?(s)? *(\^[0-9]+)?", "", s)
    s = re.sub(r"\^ *\\circ|\^\{\\circ\}", "", s)
    if len(s) > 1 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    s = re.sub(r",\\! *", "", s)
    while True:  # thousands commas, never the commas of a tuple
        t = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", s)
        if t == s:
            break
        s = t
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"- *", "-", s).strip().lower()
    s = re.sub(r"(\d) +(\d)", r"\1+\2", s)  # a mixed number: 7 3/4 is 7+3/4
    if _is_int(s):
        s = str(int(round(float(s))))
    return s


def _is_int(s: str) -> bool:
    try:
        x = float(s)
    except ValueError:
        return False
    return math.isfinite(x) and abs(x - round(x)) <= 1e-7


def _split_top(s: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _elements(s: str) -> list[str]:
    """A tuple or interval's elements (brackets kept apart by the caller), else ``[s]``."""
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and _split_top(s[1:-1], ",") != [s[1:-1]]:
        inner = s[1:-1]
        if not any(ch in inner for ch in "()[]"):
            return _split_top(inner, ",")
    return [s]


def _matrix(s: str) -> list[list[str]] | None:
    m = _MATRIX.search(s)
    if not m:
        return None
    rows = [r for r in re.split(r"\\\\", m.group(1)) if r.strip()]
    return [[c.strip() for c in r.split("&")] for r in rows]


def _numbers_close(a: float, b: float, tolerance: float) -> bool:
    return any(math.isclose(a, ref, rel_tol=tolerance, abs_tol=1e-12)
               for ref in (b, b / 100, b * 100))


def _same_function(a, b) -> bool:
    """Two expressions in unknowns are one when they agree at three fixed points (where one is
    undefined there: when their difference expands to 0). ``simplify`` can run for minutes and
    ``expand`` for seconds on a large power; evaluating at a point cannot."""
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    for point in _PROBES:
        values = dict(zip(symbols, point, strict=False))
        x, y = complex(a.evalf(subs=values)), complex(b.evalf(subs=values))
        if not all(math.isfinite(v) for v in (x.real, x.imag, y.real, y.imag)):
            from sympy import expand

            return bool(expand(a - b) == 0)
        if not abs(x - y) <= 1e-9 * max(1.0, abs(y)):
            return False
    return True


def _value_equal(given: str, truth: str, tolerance: float | None) -> bool:
    if given == truth:
        return True
    frac = r"-?\d+/0*[1-9]\d*"
    if tolerance is None:
        if re.fullmatch(frac, given) and re.fullmatch(frac, truth):
            return False  # unreduced fractions count as written
        if _is_int(truth) != _is_int(given):
            return False
    a, b = latex_to_sympy(given), latex_to_sympy(truth)
    if a is None or b is None:
        return False
    try:
        if a.free_symbols or b.free_symbols:
            return _same_function(a, b)
        x, y = complex(a.evalf()), complex(b.evalf())
    except Exception:  # sympy cannot settle it: not the same, as a grader must answer
        return False
    if x.imag or y.imag:
        return abs(x - y) <= 1e-9 * max(1.0, abs(y))
    if tolerance is None:
        return math.isclose(x.real, y.real, rel_tol=1e-9, abs_tol=1e-12)
    return _numbers_close(x.real, y.real, tolerance)


def equivalent(given: str | None, truth: str, tolerance: float | None = None) -> bool:
    """Whether ``given`` is the same answer as ``truth`` (the module docstring has the rules).

    Args:
        given: the response's answer; None (none found) is never right.
        truth: the ground truth.
        tolerance: None: strict (PRM800K); a float: PRIME's lenient mode with this relative
            tolerance on numbers.

    Returns:
        True when they match.
    """
    if given is None:
        return False
    if normalize_math(given) == normalize_math(truth):
        return True
    g_rows, t_rows = _matrix(given), _matrix(truth)
    if g_rows is not None or t_rows is not None:
        if g_rows is None or t_rows is None or [len(r) for r in g_rows] != [len(r) for r in t_rows]:
            return False
        return all(equivalent(g, t, tolerance) for gr, tr in zip(g_rows, t_rows, strict=True)
                   for g, t in zip(gr, tr, strict=True))
    g, t = _clean(given), _clean(truth)
    if g == t:
        return True
    if not g:
        return False
    g_parts, t_parts = _elements(g), _elements(t)
    if len(g_parts) != len(t_parts):
        return False
    if len(t_parts) > 1 and (g[0] != t[0] or g[-1] != t[-1]):
        return False  # (a, b) is not [a, b]
    return all(_value_equal(a, b, tolerance) for a, b in zip(g_parts, t_parts, strict=True))
