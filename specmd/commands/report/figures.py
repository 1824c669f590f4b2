"""Step 3 of a report: matplotlib figures in the papers' layouts, from a section's groups.

A figure entry of an experiment's ``report.figures``::

    kind: bars | lines | scatter
    x:       bars: the axis naming each bar; lines/scatter: a metric expression (``config.hardware.capacity``
             reads a config value); lines without x: the index of a list-valued y (layer, score rank)
    y:       a metric expression (expressions.py); ``overlay`` (bars): a second one drawn over y in red (SpecMD
             Fig. 4: grey total misses, red collision misses)
    series:  axis or list of axes: one line / marker set per value (legend)
    panels:  axis: one subplot per value
    label:   axes whose values annotate scatter points; connect: join a series' points in x order
    percent / percent_x: show y / x as %; logx / logy; zero_lines: lines through 0 (relative plots)
    xlabel, ylabel, title; hline: baseline -> a dashed line at y of the report's ``baseline`` group
    also:    (lines) more metrics drawn per series in the series' colour, each ``{y: expr, label: text, style:
             ":" | "--" | "-.", when: {axis: value}}`` (the measured points beside the simulated line; a bound),
             ``when`` keeping the groups whose axes (or config keys: ``execution.name``) have those values
"""

from __future__ import annotations

import math
from pathlib import Path

from ...errors import ConfigError
from .expressions import job_value, numeric, split_prefix
from .tables import MISSING, Group, sort_key, unnamed_axes

KINDS = ("bars", "lines", "scatter")
KEYS = {"kind", "x", "y", "overlay", "series", "panels", "label", "connect", "percent", "percent_x", "logx",
        "logy", "zero_lines", "xlabel", "ylabel", "title", "hline", "also"}


def _as_list(v) -> list:
    return [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]


def _name(group: Group, job, axes: list) -> str:
    from .tables import axis_value

    vals = [group.axes.get(a) or axis_value(job, a) for a in axes]
    vals = [v for v in vals if v and v != MISSING]
    return " ".join(vals) if vals else "all"


def _value(spec, group: Group, groups: list, expr: str):
    """Group mean of a figure expression (rel: prefixes handled like table cells, unscaled)."""
    from .tables import cell

    prefix, _ = split_prefix(expr)
    if prefix:
        mean, _, _ = cell(spec, "", expr, group, groups)
        return mean
    vals = [job_value(j, expr) for j in group.ok]  # a value that is no finite number: recorded, never drawn
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    if isinstance(vals[0], list):  # list-valued (per layer / per rank): element-wise mean over repeats
        vals = [v for v in vals if isinstance(v, list)]
        n = min(len(v) for v in vals)
        cols = [[v[i] for v in vals if numeric(v[i])] for i in range(n)]
        return [sum(c) / len(c) if c else None for c in cols]
    nums = [v for v in vals if numeric(v)]
    return sum(nums) / len(nums) if nums else None


def _figure_kind(spec, fig_spec: dict) -> str:
    """Check a figure entry's keys and the axes its kind needs; its kind."""
    bad = sorted(set(fig_spec) - KEYS)
    kind = fig_spec.get("kind")
    if bad or kind not in KINDS:
        raise ConfigError(f"report.figures of {spec.id}: kind={kind!r} (valid: {', '.join(KINDS)}); unknown keys "
                          f"{bad} (valid: {', '.join(sorted(KEYS))})")
    need = ("x", "y") if kind in ("bars", "scatter") else ("y",)
    missing = [k for k in need if not fig_spec.get(k)]
    if missing:
        raise ConfigError(f"report.figures of {spec.id}: kind={kind} needs {' and '.join(missing)}")
    return kind


def _baseline_value(spec, fig_spec: dict, groups: list, ok: list):
    """The y of the report's baseline group for ``hline: baseline`` (None without one, or when it is a curve)."""
    base = None
    if fig_spec.get("hline") == "baseline" and spec.baseline:
        from .tables import baseline_of

        ref = baseline_of(spec, Group({}), [g for g in ok])
        base = _value(spec, ref, groups, fig_spec["y"]) if ref is not None else None
        base = base if isinstance(base, (int, float)) else None  # a curve has no single baseline value
    return base


def _dress_panel(ax, fig_spec: dict, panel_axis, panel, base, py: float) -> None:
    """A drawn panel's title, log scales, baseline and zero lines, x label and grid."""
    if panel_axis:
        ax.set_title(f"{panel_axis} = {panel}", fontsize=9)
    if fig_spec.get("logx"):
        ax.set_xscale("log")
    if fig_spec.get("logy"):
        ax.set_yscale("log")
    if fig_spec.get("hline") == "baseline" and base is not None:
        ax.axhline(base * py, color="0.3", ls="--", lw=1, label="baseline")
    if fig_spec.get("zero_lines"):
        ax.axhline(0, color="0.6", lw=0.8)
        ax.axvline(0, color="0.6", lw=0.8)
    ax.set_xlabel(fig_spec.get("xlabel") or fig_spec.get("x") or "index")
    ax.grid(alpha=0.3)


def draw(spec, fig_spec: dict, groups: list, path: Path) -> str:
    """Render one figure into ``path`` (png); returns a one-line caption."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = _figure_kind(spec, fig_spec)
    ok = [g for g in groups if g.ok]
    panel_axis = fig_spec.get("panels")
    panels = sorted({_name(g, g.ok[0], [panel_axis]) for g in ok}, key=sort_key) if panel_axis else ["all"]
    fig, axs = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1.2, 3.6), squeeze=False,
                            sharey=kind != "scatter")
    series_axes = _as_list(fig_spec.get("series"))
    # axes the spec does not name (a swept override it leaves out, a config key that tells runs apart: two
    # models) split the series, or name the bars: their values are never drawn as one
    extra = [a for a in unnamed_axes(spec, groups) if a not in series_axes + [panel_axis, fig_spec.get("x")]]
    series_axes = series_axes + extra
    py = 100.0 if fig_spec.get("percent") else 1.0
    base = _baseline_value(spec, fig_spec, groups, ok)
    px = 100.0 if fig_spec.get("percent_x") else 1.0
    for ax, panel in zip(axs[0], panels):
        members = [g for g in ok if not panel_axis or _name(g, g.ok[0], [panel_axis]) == panel]
        if kind == "bars":
            _bars(spec, fig_spec, members, groups, ax, py, extra)
        else:
            _lines(spec, fig_spec, members, groups, ax, series_axes, kind, px, py)
        _dress_panel(ax, fig_spec, panel_axis, panel, base, py)
    axs[0][0].set_ylabel(fig_spec.get("ylabel") or fig_spec.get("y"))
    title = fig_spec.get("title") or spec.title
    import textwrap

    fig.suptitle(textwrap.fill(title, int(14 * fig.get_figwidth())), fontsize=10)  # ~14 characters per inch
    handles, labels = axs[0][-1].get_legend_handles_labels()
    if handles:
        axs[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    from ...results import write_file

    try:  # an interrupt leaves no half figure; a full disk names the figure and keeps it elsewhere
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format=Path(path).suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
    return title


def _bars(spec, fs, members, groups, ax, py, extra=()):
    x_axis = fs.get("x")
    names = [_name(g, g.ok[0], [x_axis, *extra]) for g in members]
    ys = [_value(spec, g, groups, fs["y"]) for g in members]
    pos = range(len(members))
    ax.bar(pos, [(y or 0) * py for y in ys], color="0.7", label=fs.get("y"))
    if fs.get("overlay"):
        ov = [_value(spec, g, groups, fs["overlay"]) for g in members]
        ax.bar(pos, [(v or 0) * py for v in ov], color="tab:red", width=0.5, label=fs["overlay"])
    ax.set_xticks(list(pos))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)


def _lines(spec, fs, members, groups, ax, series_axes, kind, px, py):
    by_series: dict = {}
    for g in members:
        by_series.setdefault(_name(g, g.ok[0], series_axes), []).append(g)
    label_axes = _as_list(fs.get("label"))
    for name, gs in by_series.items():
        pts = []
        for g in gs:
            y = _value(spec, g, groups, fs["y"])
            if isinstance(y, list):  # a per-layer / per-rank curve: x is the index (None: a gap)
                ax.plot(range(len(y)), [math.nan if v is None else v * py for v in y], marker=".",
                        label=name if len(gs) == 1 else
                        f"{name} {_name(g, g.ok[0], label_axes)}".strip())
                continue
            x = _value(spec, g, groups, fs["x"]) if fs.get("x") else None
            if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
                continue  # absent here (the other half of a merged figure) or not a number
            pts.append((float(x) * px, y * py, _name(g, g.ok[0], label_axes) if label_axes else ""))
        if not pts:
            continue
        pts.sort()
        xs, ys, labels = zip(*pts)
        if kind == "lines" or fs.get("connect"):
            (line,) = ax.plot(xs, ys, marker="o", ms=4, label=name)
            for extra in fs.get("also") or []:
                when = extra.get("when") or {}
                more = sorted((float(x) * px, y * py) for g in gs
                              if all(_name(g, g.ok[0], [k]) == str(v) for k, v in when.items())
                              for x, y in [(_value(spec, g, groups, fs["x"]), _value(spec, g, groups, extra["y"]))]
                              if isinstance(x, (int, float)) and isinstance(y, (int, float)))
                if more:
                    ax.plot(*zip(*more), linestyle=extra.get("style", ":"), marker="x", ms=4, color=line.get_color(),
                            label=f"{name} {extra.get('label', extra['y'])}")
        else:
            ax.scatter(xs, ys, s=22, label=name)
        for x, y, lab in pts:
            if lab and lab != "all":
                ax.annotate(lab, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
