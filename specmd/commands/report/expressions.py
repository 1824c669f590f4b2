"""The metric expressions of a report's spec (``metrics``, a figure's ``y``, a check's values), evaluated on a
job's results.

A metric is an arithmetic expression over dotted paths into the job's results (``cache.misses /
cache.requests``, ``timing.ttft_s * 1000``; operators and parentheses separated by spaces, because task
metric names contain ``/`` and ``-``), optionally prefixed by ``rel:`` (``x / baseline - 1``), ``rel-:``
(``baseline / x - 1``, for lower-is-better values such as perplexity), ``reduction:`` (``1 - x /
baseline``, e.g. a TTFT reduction), ``mean_first_half:`` or
``mean_second_half:`` (of a per-layer list). A path into a list may index it (``probability.0``, ``.-1``).

A value a metric reads must be a finite number: NaN, Infinity, a string, a boolean or a mapping in
results.json is recorded on its job (``Job.problems``: path -> what it is), left out of every number, and
named by the report (and by a verdict, which is then not measured). ``null`` is results.json's own "not
measured" (TPOT of a run without decode passes, an lm-eval score without a value): a value absent, as before.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any, Optional

from ...errors import ConfigError

PREFIXES = ("rel:", "rel-:", "reduction:", "mean_first_half:", "mean_second_half:")


def lookup(tree: Any, path: str) -> Any:
    """``a.b.0.c`` in nested dicts/lists; None when absent."""
    node = tree
    for part in path.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and re.fullmatch(r"-?\d+", part):
            i = int(part)
            node = node[i] if -len(node) <= i < len(node) else None
        else:
            return None
        if node is None:
            return None
    return node


_TOKEN = re.compile(r"\(|\)|[^\s()]+")
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Add, ast.Sub, ast.Mult,
            ast.Div, ast.USub)


def _number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False


def problem(v: Any) -> Optional[str]:
    """What a value read from results.json is when it is no number a metric can use (``NaN``, ``Infinity``,
    ``a string ('0.5'), not a number``...); None for a number, and for None (absent, or null: not measured)."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        return None
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean), not a number"
    if isinstance(v, str):
        return f"a string ({v[:40]!r}), not a number"
    if isinstance(v, dict):
        return "a mapping, not a number"
    if isinstance(v, list):
        return "a list, not a number"
    return f"a {type(v).__name__}, not a number"


NON_FINITE = ("NaN", "Infinity", "-Infinity")


def _read(results: dict, path: str, bad: Optional[dict], scalar: bool) -> Any:
    """The value at ``path``: a number, a list of numbers (None where an element is no number) when not
    ``scalar``, or None; what was no number goes into ``bad`` (path -> :func:`problem`)."""
    v = lookup(results, path)
    if isinstance(v, list) and not scalar:
        out = []
        for i, x in enumerate(v):
            why = problem(x)
            if why is not None and bad is not None:
                bad[f"{path}.{i}"] = why
            out.append(None if why else x)
        return out
    why = problem(v)
    if why is not None:
        if bad is not None:
            bad[path] = why
        return None
    return v


def evaluate(results: dict, expr: str, bad: Optional[dict] = None) -> Any:
    """A metric expression (module docstring) on one job's results (``config`` included); None if a path is
    absent, null, or holds no finite number (then recorded in ``bad``: path -> what it holds). A bare path may
    yield a list (per-layer or per-rank values)."""
    for p in ("mean_first_half:", "mean_second_half:"):
        if expr.startswith(p):
            values = evaluate(results, expr[len(p):], bad)
            if not isinstance(values, list) or not values:
                return None
            h = len(values) // 2
            part = values[:h] if p == "mean_first_half:" else values[h:]
            part = [v for v in part if v is not None]
            return sum(part) / len(part) if part else None
    tokens = _TOKEN.findall(expr)
    if len(tokens) == 1:
        return _read(results, tokens[0], bad, scalar=False)
    names, py = {}, []
    for tok in tokens:
        if re.fullmatch(r"[-+*/]{2,}", tok):
            raise ConfigError(f"report metric {expr!r}: only + - * / and parentheses between paths and numbers")
        if tok in ("(", ")", "+", "-", "*", "/") or _number(tok):
            py.append(tok)
        else:
            v = _read(results, tok, bad, scalar=True)
            if v is None:
                return None
            names.setdefault(tok, f"v{len(names)}")
            py.append(names[tok])
    source = " ".join(py)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ConfigError(f"report metric {expr!r}: not an expression of paths, numbers, + - * / and "
                          f"parentheses (separate operators by spaces)") from None
    if not all(isinstance(n, _ALLOWED) for n in ast.walk(tree)):
        raise ConfigError(f"report metric {expr!r}: only + - * / and parentheses between paths and numbers")
    env = {name: lookup(results, path) for path, name in names.items()}
    try:
        return eval(compile(tree, "<metric>", "eval"), {"__builtins__": {}}, env)  # noqa: S307 (checked AST)
    except (ZeroDivisionError, OverflowError):
        return None


def paths_of(expr: str) -> list:
    """The results paths a metric expression reads (its prefix left out)."""
    rest = next((expr[len(p):] for p in PREFIXES if expr.startswith(p)), expr)
    return [t for t in _TOKEN.findall(rest) if t not in ("(", ")", "+", "-", "*", "/") and not _number(t)]


def job_value(job, expr: str) -> Any:
    """:func:`evaluate` on a job's results; a value that is no finite number is recorded on the job
    (``job.problems``, which the report names) and read as absent."""
    bad: dict = {}
    v = evaluate(job.results, expr, bad)
    problems = getattr(job, "problems", None)
    if bad and problems is not None:
        problems.update(bad)
    if isinstance(v, float) and not math.isfinite(v):  # arithmetic on finite values can overflow
        return None
    return v


def numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_PATH = re.compile(r"[A-Za-z_][\w/-]*(\.[\w/-]+)+")


def expression_error(expr: str) -> Optional[str]:
    """Why ``expr`` is not a metric expression (module docstring), or None when it is one: every operand a
    number or a dotted results path (``cache.hit_rate``), operators and parentheses between them."""
    if not isinstance(expr, str) or not expr.strip():
        return "an empty expression"
    rest = next((expr[len(p):] for p in PREFIXES if expr.startswith(p)), expr)
    py = []
    for tok in _TOKEN.findall(rest):
        if tok in ("(", ")", "+", "-", "*", "/") or _number(tok):
            py.append(tok)
        elif _PATH.fullmatch(tok):
            py.append("v")
        else:
            return f"{tok!r} is neither a number, an operator nor a dotted results path such as cache.hit_rate"
    try:
        tree = ast.parse(" ".join(py), mode="eval")
    except SyntaxError:
        return "not an expression of paths, numbers, + - * / and parentheses (separate operators by spaces)"
    if not all(isinstance(n, _ALLOWED) for n in ast.walk(tree)):
        return "only + - * / and parentheses between paths and numbers"
    return None


def split_prefix(expr: str) -> tuple[str, str]:
    for p in ("rel:", "rel-:", "reduction:"):
        if expr.startswith(p):
            return p, expr[len(p):]
    return "", expr
