"""Computed verdicts: a paper experiment's direction claims (``report.checks``) evaluated on its measured groups.

Each check states one quantitative direction the paper claims, in the experiment's own terms: a metric of
its ``report`` spec and the groups of its table, picked by axis values::

    checks:
      - claim: Least-Stale has fewer collisions than LRU at 5 %    # the paper's claim, in words (shown)
        metric: collision %                   # a label of report.metrics (its table's value), or an expression
        lower: {eviction.name: least_stale, hardware.capacity: 0.05}   # the group claimed lower (or higher:)
        than: {eviction.name: lru, hardware.capacity: 0.05}            # the group it is compared with

Optional keys: ``than`` may be a list of selectors (the claim must hold against each: "the lowest TTFT");
``than_metric`` compares with another metric (``than`` then defaults to the same group: "collisions are
higher in the second half of the layers than in the first"); ``each: AXIS`` evaluates the claim at every
value of a row or column axis that the sweep ran for the lower/higher group ("at every cache size"; the
selectors then leave that axis out).

A selector names row or column axes of the spec (``eviction`` and ``eviction.name`` are one axis) and must
pick exactly one group; its value is the group's mean over the repeat axes, as the table shows it (a
``%`` label x 100, ``rel:`` against its baseline). A claim *holds* when the lower group's value is strictly
below every ``than`` value (above, for ``higher``) at every point; it *does not hold* when it fails at some
point; it is *not measured* when a group is absent, unfinished, has no value, holds a value that is no finite
number in a finished run's results.json (NaN, Infinity, a string: the verdict names the file and the key), or
a selector matches several groups (the verdict says which). A section whose groups also differ in an axis the
spec does not name (a swept override it leaves out, or a config key that tells its runs apart: two sweeps on
two models, tables.config_split) judges each check at each value of those axes: it holds only where it holds
at every one. Values are compared as the table shows them (4 significant digits, ``%``
to 0.1): a difference the table cannot show is no difference. The experiment's verdict line counts them:
"2 of 3 claims hold; 1 not measured". Checks are validated when the spec is parsed (:func:`parse_spec`): a typo
fails before any sweep runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...errors import ConfigError
from ...loggers import flatten
from .expressions import NON_FINITE, expression_error, paths_of, split_prefix
from .tables import MISSING, Spec, axis_value, baseline_of, cell, fmt, is_percent, unnamed_axes

KEYS = ("claim", "metric", "lower", "higher", "than", "than_metric", "each")
HOLDS, FAILS, UNMEASURED = "holds", "does not hold", "not measured"
MARKS = {HOLDS: "✓", FAILS: "✗", UNMEASURED: "–"}


@dataclass
class Check:
    claim: str
    label: str  # the metric's label (its expression when it is no label of the spec)
    expr: str
    direction: str  # "lower" or "higher"
    subject: dict  # axis -> value: the group claimed lower/higher
    than: list  # [selector]: the groups it is compared with
    than_label: str = ""
    than_expr: str = ""
    each: Optional[str] = None


@dataclass
class Point:
    at: str  # "" for a check without ``each``, else the axis value it was evaluated at
    status: str
    text: str  # "least_stale 2.3 < lru 10.1", or why it was not measured
    where: str = ""  # the values of the axes the spec does not name it was judged at ("model.name=mixtral")

    @property
    def mark(self) -> str:
        return MARKS[self.status]

    def label(self, each: Optional[str]) -> str:
        """Where it was judged: ``model.name=mixtral, hardware.capacity=0.25``."""
        return ", ".join(x for x in (self.where, f"{each}={self.at}" if each and self.at != "" else "") if x)


@dataclass
class Verdict:
    check: Check
    status: str
    text: str
    points: list = field(default_factory=list)  # one per value of ``each``

    @property
    def mark(self) -> str:
        return MARKS[self.status]

    @property
    def metric(self) -> str:
        """The metric the values are of, when both sides share one (else each value names its own)."""
        return self.check.label if self.check.label == self.check.than_label else ""

    @property
    def values(self) -> str:
        """What the verdict stands on: the metric and its values (``collision %: least_stale 2.3 < lru
        10.1``), or why it was not measured."""
        if self.status == UNMEASURED and not self.points:
            return self.text
        return (f"{self.metric}: " if self.metric else "") + self.text


# --- parsing --------------------------------------------------------------------------------------------

def _axis(spec, key: str) -> Optional[str]:
    """The spec's row or column axis that ``key`` names (``eviction`` names a row ``eviction.name``)."""
    for a in spec.rows + ([spec.cols] if spec.cols else []):
        if key == a or key + ".name" == a or key == a + ".name":
            return a
    return None


def parse_spec(raw: Any, experiment: str):
    """A report spec with its checks parsed (``Spec.parse`` leaves them as written: this module builds on
    tables.py, not the other way round); every spec error, checks included, is raised here."""
    spec = Spec.parse(raw, experiment)
    if spec.checks:
        spec.checks = parse_checks(spec.checks, spec, experiment)
    return spec


def _check_direction(c: Any, bad) -> str:
    """Check one entry's shape (a mapping of known keys with a claim); its direction: "lower" or "higher"."""
    if not isinstance(c, dict):
        raise bad(f"a mapping with keys {', '.join(KEYS)}, not {c!r}")
    unknown = sorted(set(c) - set(KEYS))
    if unknown:
        raise bad(f"unknown key(s) {unknown}; valid: {', '.join(KEYS)}")
    if not isinstance(c.get("claim"), str) or not c["claim"].strip():
        raise bad("needs claim: the paper's claim in words")
    sides = [d for d in ("lower", "higher") if c.get(d) is not None]
    if len(sides) != 1:
        raise bad("needs exactly one of lower: or higher: (the group the paper claims lower or higher), "
                  f"got {' and '.join(sides) or 'neither'}")
    return sides[0]


def _check_metric(c: dict, key: str, labels: dict, bad) -> tuple[str, str]:
    """The (label, expression) that ``c[key]`` names: a label of report.metrics, or an expression as its own label."""
    m = c.get(key)
    if not isinstance(m, str) or not m.strip():
        raise bad(f"needs {key}: a label of report.metrics ({', '.join(labels) or 'none'}) or an expression")
    if m in labels:
        return m, labels[m]
    why = expression_error(m)
    if why:
        raise bad(f"{key} {m!r} is neither a label of report.metrics ({', '.join(labels) or 'none'}) "
                  f"nor an expression: {why}")
    return m, m


def _selector(s: Any, where: str, spec, axes: list, each: Optional[str], bad) -> dict:
    """A selector -> {axis: value}: one value for each row or column axis it names, never the each: axis."""
    if not isinstance(s, dict):
        raise bad(f"{where} must map axes to values ({{eviction.name: lru}}), not {s!r}")
    sel = {}
    for k, v in flatten(s).items():  # a spec read back from W&B may arrive nested: {eviction: {name: lru}}
        a = _axis(spec, str(k))
        if a is None:
            raise bad(f"{where} names {k!r}, not a row or column axis of the spec "
                      f"({', '.join(axes) or 'none'})")
        if isinstance(v, (list, dict)) or v is None:
            raise bad(f"{where}: {k} must be one value, not {v!r}")
        if a == each:
            raise bad(f"{where} names {k!r}, the each: axis (the check runs at each of its values)")
        sel[a] = v
    return sel


def _each_axis(c: dict, spec, axes: list, bad) -> Optional[str]:
    """The row or column axis that ``each:`` names (None without ``each:``)."""
    each = None
    if c.get("each") is not None:
        each = _axis(spec, str(c["each"]))
        if each is None:
            raise bad(f"each: {c['each']!r} is not a row or column axis of the spec ({', '.join(axes) or 'none'})")
    return each


def _than(c: dict, subject: dict, spec, axes: list, each: Optional[str], bad) -> list:
    """The groups compared with: ``than``'s selector(s), or the subject itself when only ``than_metric`` is given."""
    raw_than = c.get("than")
    if raw_than is None:
        if c.get("than_metric") is None:
            raise bad("needs than: the group(s) compared with (or than_metric: to compare two metrics of one "
                      "group)")
        return [dict(subject)]
    items = raw_than if isinstance(raw_than, list) else [raw_than]
    if not items:
        raise bad("than: an empty list")
    return [_selector(s, f"than[{j}]" if isinstance(raw_than, list) else "than", spec, axes, each, bad)
            for j, s in enumerate(items)]


def _parse_check(c: Any, name: str, spec, labels: dict, axes: list) -> Check:
    """One entry of ``report.checks`` -> a Check; a ConfigError starting with ``name`` for anything wrong."""

    def bad(why: str):
        return ConfigError(f"{name}: {why}")

    direction = _check_direction(c, bad)
    label, expr = _check_metric(c, "metric", labels, bad)
    each = _each_axis(c, spec, axes, bad)
    subject = _selector(c[direction], direction, spec, axes, each, bad)
    than_label, than_expr = (_check_metric(c, "than_metric", labels, bad) if c.get("than_metric") is not None
                             else (label, expr))
    than = _than(c, subject, spec, axes, each, bad)
    return Check(c["claim"].strip(), label, expr, direction, subject, than, than_label, than_expr, each)


def parse_checks(raw: Any, spec, experiment: str) -> list:
    """``report.checks`` -> [Check]; a ConfigError naming the experiment and the check for anything wrong."""
    if not isinstance(raw, list):
        raise ConfigError(f"report.checks of {experiment}: a list of checks, not {type(raw).__name__}")
    labels = dict(spec.metrics)
    axes = spec.rows + ([spec.cols] if spec.cols else [])
    out = []
    for i, c in enumerate(raw):
        name = f"report.checks[{i}] of {experiment}" + (f" ({c.get('claim')!r})" if isinstance(c, dict) and
                                                        c.get("claim") else "")
        out.append(_parse_check(c, name, spec, labels, axes))
    return out


# --- evaluation -----------------------------------------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    """An axis value (a string from an override or the config) equals a selector's value (YAML: 0.05, 8,
    true, lru): as text, or as numbers (0.0 and 0, 0.50 and 0.5)."""
    norm = lambda x: str(x).lower() if isinstance(x, bool) else str(x)  # noqa: E731
    if norm(a) == norm(b):
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _value_of(group, axis: str) -> str:
    return group.axes[axis] if axis in group.axes else axis_value(group.jobs[0], axis)


def _describe(sel: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sel.items()) or "(every group)"


def _pick(groups: list, sel: dict) -> tuple[Optional[Any], Optional[str]]:
    """The one group ``sel`` selects, or why there is none."""
    found = [g for g in groups if all(_same(_value_of(g, k), v) for k, v in sel.items())]
    if not found:
        return None, f"no group has {_describe(sel)}"
    if len(found) > 1:
        differ = [a for a in found[0].axes if len({g.axes.get(a) for g in found}) > 1]
        return None, (f"{_describe(sel)} matches {len(found)} groups, which differ in {', '.join(differ)}: "
                      "the selector must name one")
    return found[0], None


def _measure(spec, groups: list, sel: dict, label: str, expr: str):
    """(mean, runs, of jobs) of the group ``sel`` selects, or (None, why, None)."""
    g, why = _pick(groups, sel)
    if g is None:
        return None, why, None
    if g.status() != "ok":
        return None, f"{_describe(sel)}: {'not run' if g.status() == 'missing' else g.status()}", None
    mean, _, n = cell(spec, label, expr, g, groups)
    bad = _bad_values(spec, expr, g, groups)
    if bad:
        return None, f"{_describe(sel)}: {bad}", None
    if mean is None:
        return None, f"{_describe(sel)}: no value of {label}", None
    return mean, n, len(g.jobs)


def _bad_values(spec, expr: str, g, groups: list) -> Optional[str]:
    """``NaN in <file> (cache.collision_rate)``: a value of ``expr`` that is no finite number in a finished
    job of the group (or of its baseline, for a ``rel:`` metric); a claim is not judged on what is left."""
    prefix, inner = split_prefix(expr)
    paths = paths_of(inner)
    jobs = list(g.ok)
    if prefix:
        base = baseline_of(spec, g, groups)
        jobs += base.ok if base is not None else []
    found = []
    for j in jobs:
        for key, why in (getattr(j, "problems", None) or {}).items():
            if any(key == p or key.startswith(p + ".") for p in paths):
                kind = why if why in NON_FINITE else f"a non-numeric value ({why})"
                found.append(f"{kind} in {j.file} ({key})")
    if not found:
        return None
    return "; ".join(found[:2]) + (f"; and {len(found) - 2} more" if len(found) > 2 else "")


def shown(mean: float, label: str) -> tuple[str, float]:
    """A value as the table shows it (``fmt``: 4 significant digits, a ``%`` label to 0.1), and that number:
    checks compare what the reader sees, so a difference the table cannot show (2540 vs 2540) is no
    difference."""
    text = fmt(mean, None, 1, is_percent(label))
    return text, float(text)


def _short(sel: dict, keys: list, label: str) -> str:
    """What tells a selected group from the ones it is compared with: its values of the axes they differ in
    (``lru``; a number with its axis, ``h=1``), else the metric's label (one group, two metrics)."""
    def one(k: str) -> str:
        v = str(sel[k])
        try:
            float(v)
        except ValueError:
            return v
        return f"{k.rsplit('.', 1)[-1]}={v}"

    return " ".join(one(k) for k in keys if k in sel) or label


def _point(spec, groups: list, check: Check, subject: dict, than: list, at: str) -> Point:
    a = _measure(spec, groups, subject, check.label, check.expr)
    bs = [_measure(spec, groups, t, check.than_label, check.than_expr) for t in than]
    why = [m[1] for m in [a] + bs if m[0] is None]
    if why:
        return Point(at, UNMEASURED, "; ".join(dict.fromkeys(why)))
    (ta, va), shown_b = shown(a[0], check.label), [shown(b[0], check.than_label) for b in bs]

    def runs(m) -> str:
        return f" ({m[1]} of {m[2]} runs)" if m[1] < m[2] else ""

    def op(x: float, y: float) -> str:
        return "<" if x < y else ">" if x > y else "="

    ok = all((va < vb) if check.direction == "lower" else (va > vb) for _, vb in shown_b)
    sels = [subject] + than  # name the axes they differ in (or that some leave out)
    keys = [k for k in dict.fromkeys(k for s in sels for k in s)
            if not all(k in s and k in subject and _same(s[k], subject[k]) for s in sels)]
    left = f"{_short(subject, keys, check.label)} {ta}{runs(a)}"
    right = ", ".join(f"{op(va, vb)} {_short(t, keys, check.than_label)} {tb}{runs(b)}"
                      for t, b, (tb, vb) in zip(than, bs, shown_b))
    return Point(at, HOLDS if ok else FAILS, f"{left} {right}")


def judge(check: Check, spec, groups: list) -> Verdict:
    """The verdict of one check on a section's groups: at each value of the axes the spec does not name (each
    model of two sweeps on two models), and over them: it holds only where it holds at every one."""
    extra = unnamed_axes(spec, groups)
    if not extra:
        return _judge(check, spec, groups)
    combos = list(dict.fromkeys(tuple(g.axes.get(a) for a in extra) for g in groups))
    parts = []
    for combo in combos:
        where = ", ".join(f"{a}={v}" for a, v in zip(extra, combo))
        v = _judge(check, spec, [g for g in groups if tuple(g.axes.get(a) for a in extra) == combo])
        parts.append((where, v))
    points = []
    for where, v in parts:
        if v.points:
            points += [Point(p.at, p.status, p.text, where) for p in v.points]
        else:
            points.append(Point("", v.status, v.text, where))
    status, text = _over(" × ".join(extra), [(w, v.status) for w, v in parts], "; ")
    return Verdict(check, status, text, points)


def _over(axis: str, parts: list, sep: str) -> tuple:
    """``(status, text)`` of a check judged at each value of ``axis`` (``parts``: (value, status)): it holds
    only where it holds at every value; it fails where it fails at one."""
    held = [w for w, st in parts if st == HOLDS]
    failed = [w for w, st in parts if st == FAILS]
    unmeasured = [w for w, st in parts if st == UNMEASURED]
    n = len(parts)
    if failed:
        return FAILS, f"holds at {len(held)} of {n} {axis} values; not at {sep.join(failed)}"
    if unmeasured:
        return UNMEASURED, f"holds at {len(held)} of {n} {axis} values; not measured at {sep.join(unmeasured)}"
    return HOLDS, f"holds at every {axis} value ({n} of {n})"


def _judge(check: Check, spec, groups: list) -> Verdict:
    if check.each is None:
        p = _point(spec, groups, check, check.subject, check.than, "")
        return Verdict(check, p.status, p.text)
    values = list(dict.fromkeys(
        _value_of(g, check.each) for g in groups
        if all(_same(_value_of(g, k), v) for k, v in check.subject.items()) and _value_of(g, check.each) != MISSING))
    if not values:
        return Verdict(check, UNMEASURED, f"no group has {_describe(check.subject)}")
    points = [_point(spec, groups, check, {**check.subject, check.each: v},
                     [{**t, check.each: v} for t in check.than], v) for v in values]
    status, text = _over(check.each, [(p.at, p.status) for p in points], ", ")
    return Verdict(check, status, text, points)


def verdicts(spec, groups: list) -> list:
    return [judge(c, spec, groups) for c in spec.checks]


def summary(vs: list) -> str:
    """The experiment's verdict line: "2 of 3 claims hold; 1 not measured"."""
    if not vs:
        return ""
    count = {s: sum(v.status == s for v in vs) for s in (HOLDS, FAILS, UNMEASURED)}
    n = len(vs)
    line = f"{count[HOLDS]} of {n} claim{'s' if n != 1 else ''} hold{'s' if n == 1 else ''}"
    if count[FAILS]:
        line += f"; {count[FAILS]} {'does' if count[FAILS] == 1 else 'do'} not hold"
    if count[UNMEASURED]:
        line += f"; {count[UNMEASURED]} not measured"
    return line


def markdown(vs: list) -> list:
    """The verdict as markdown lines: the summary, then one line per check."""
    if not vs:
        return []
    lines = [f"**Verdict:** {summary(vs)}", ""]
    for v in vs:
        lines.append(f"- {v.mark} **{v.status}**: {v.check.claim} — {v.values}")
        lines += [f"  - {p.mark} {p.label(v.check.each)}: {p.text}" for p in v.points]
    return lines + [""]
