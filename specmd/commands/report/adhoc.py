"""Step 3 of a report, for an ad-hoc sweep: the figures a sweep without a ``report`` spec gets.

An ad-hoc sweep (``python -m specmd -m replay.trace=T eviction=lru,least_stale hardware.capacity=0.01,0.05``,
no ``+experiment=``) names no figures, yet its reader asks two questions of it: how does each knob I swept
move the cache and the speed, and which configurations are worth their cost. So, per swept axis (a row
axis of the section: every override that varies, the repeat axes averaged as in the table):

* that axis against hit rate, collision rate and TPOT (``METRICS``), one series per combination of the other
  axes: grouped bars over a categorical axis (eviction, in the sweep's order), lines over a numeric one
  (capacity, sorted as numbers, log x when it spans more than a decade); std error bars over repeats;
* and one Pareto plot per task whose quality varies when TPOT varies too: quality against TPOT (TTFT for
  runs that decode nothing, such as perplexity scoring), the configurations no other beats on both marked
  and joined (the frontier).

A metric no finished job reports draws nothing and leaves a note; jobs that did not finish are never
drawn (the section lists them). File names depend only on the section id, the axis and the metric
(``<id>_<axis>_<metric>.png``, ``<id>_pareto_<task>.png``), so a re-run overwrites rather than piles up.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Optional

from .tables import MISSING

# (file key, label, unit, results path, scale to the unit)
METRICS = (("hit", "hit rate", "%", "cache.hit_rate", 100.0),
           ("collision", "collision rate", "%", "cache.collision_rate", 100.0),
           ("tpot", "TPOT", "ms", "timing.tpot_s", 1000.0))
# the speed of a Pareto plot: TPOT, else TTFT (runs that decode nothing: perplexity scoring)
SPEEDS = (METRICS[2], ("ttft", "TTFT", "ms", "timing.ttft_s", 1000.0))
# units of the axes a user sweeps most (an x label says what its numbers are)
AXIS_UNITS = {"hardware.capacity": "fraction of the model's bytes", "hardware.bandwidth_gbps": "GB/s",
              "hardware.latency_us": "µs", "hardware.experts_per_layer": "experts per layer",
              "eval.max_gen_toks": "tokens", "eval.limit": "documents"}
FIGSIZE = (5.2, 3.6)  # inches at DPI: ~530 px wide, so two sit side by side, unscaled, in the page's 1200 px
DPI = 100
# every text >= 10 pt at 100 dpi (>= 13.9 px: 10.4 CSS pt shown at natural size)
RC = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 10, "ytick.labelsize": 10,
      "legend.fontsize": 10, "legend.title_fontsize": 10, "figure.titlesize": 11}


def slug(text: str) -> str:
    """A file-name-safe form of an axis or task name (``hardware.capacity`` stays as is)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def is_numeric(values: list) -> bool:
    try:
        [float(v) for v in values]
    except ValueError:
        return False
    return bool(values)


def _stats(group, expr: str, scale: float) -> Optional[tuple]:
    """(mean, std or None) of a group's finished jobs, in the figure's unit; None when none reports it."""
    vals = [v * scale for v in group.values(expr) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not vals:
        return None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def _series_name(group, others: list) -> str:
    return ", ".join(group.axes[o] for o in others) or "all"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    from ...results import write_file

    try:  # an interrupt leaves no half figure; a full disk names the figure and keeps it elsewhere
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=DPI, bbox_inches="tight", pad_inches=0.08,
                                                 format=Path(path).suffix.lstrip(".") or "png"))
    finally:
        _plt().close(fig)


def axis_series(axis: str, others: list, metric: tuple, groups: list) -> tuple[dict, Optional[list]]:
    """{series name: [(x, mean, std)]} of ``axis`` against ``metric`` over the groups reporting it, and the
    categories in the sweep's order (None: a numeric axis, whose x are floats sorted as numbers)."""
    expr, scale = metric[3], metric[4]
    pts = [(g, _stats(g, expr, scale)) for g in groups if g.axes.get(axis, MISSING) != MISSING]
    pts = [(g, st) for g, st in pts if st is not None]
    numeric = is_numeric([g.axes[axis] for g, _ in pts])
    series: dict = {}
    for g, (mean, sd) in pts:
        series.setdefault(_series_name(g, others), []).append(
            (float(g.axes[axis]) if numeric else g.axes[axis], mean, sd))
    if numeric:  # as numbers: 0.25 after 0.05, 10 after 9
        series = {name: sorted(p) for name, p in series.items()}
    return series, None if numeric else list(dict.fromkeys(g.axes[axis] for g, _ in pts))


def axis_figure(axis: str, others: list, metric: tuple, groups: list, path: Path) -> Optional[str]:
    """``axis`` against one metric, a series per combination of ``others``; None (nothing written) when no
    group reports the metric. Returns the caption."""
    _, label, unit, _, _ = metric
    series, categories = axis_series(axis, others, metric, groups)
    if not series:
        return None
    plt = _plt()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
        if categories is None:
            _lines(ax, series)
        else:
            _grouped_bars(ax, series, categories)
        ys = [m for pts in series.values() for _, m, _ in pts]
        if min(ys) >= 0 and (categories is not None or max(ys) == 0):  # rates and times: bars from 0, and
            ax.set_ylim(0 if categories else -0.05, None if max(ys) > 0 else 1)  # never a -0.05 % hit rate
        unit_x = AXIS_UNITS.get(axis)
        ax.set_xlabel(f"{axis} ({unit_x})" if unit_x else axis)
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(f"{label} by {axis}")
        ax.grid(alpha=0.3, axis="both" if categories is None else "y")
        if others:
            fig.legend(loc="outside lower center", ncol=min(len(series), 3), title=", ".join(others),
                       frameon=False)
        _save(fig, path)
    return f"{label} ({unit}) by {axis}" + (f", one series per {', '.join(others)}" if others else "")


def _lines(ax, series: dict) -> None:
    xs_all = []
    for name, pts in series.items():
        xs, ms, ss = zip(*pts, strict=True)
        xs_all += xs
        ax.errorbar(xs, ms, yerr=[s or 0.0 for s in ss] if any(ss) else None, marker="o", ms=5, capsize=3,
                    label=name)
    lo, hi = min(xs_all), max(xs_all)
    if lo > 0 and hi / lo > 10:  # more than a decade: equal steps of a geometric sweep look equal
        ax.set_xscale("log")
        from matplotlib.ticker import NullFormatter

        ax.xaxis.set_minor_formatter(NullFormatter())
    ticks = sorted(set(xs_all))
    if len(ticks) <= 10:  # the swept values themselves
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])


def _grouped_bars(ax, series: dict, categories: list) -> None:
    """One cluster per category, a bar per series; values printed on the bars when few (a 0 bar is invisible)."""
    n = len(series)
    width = 0.8 / n
    label_bars = n * len(categories) <= 12
    for i, (name, pts) in enumerate(series.items()):
        at = {x: (m, s) for x, m, s in pts}
        pos = [c + (i - (n - 1) / 2) * width for c, x in enumerate(categories) if x in at]
        vals = [at[x] for x in categories if x in at]
        bars = ax.bar(pos, [m for m, _ in vals], width * 0.95, label=name,
                      yerr=[s or 0.0 for _, s in vals] if any(s for _, s in vals) else None, capsize=3)
        if label_bars:
            ax.bar_label(bars, fmt="%.3g", padding=2, fontsize=10)
    ax.set_xticks(range(len(categories)), categories, rotation=20 if len(categories) > 4 else 0)
    ax.set_xlim(-0.6, len(categories) - 0.4)
    ax.margins(y=0.12)  # room above the tallest bar for its value


def frontier(points: list, higher_is_better: bool) -> list:
    """The points (speed, quality, ...) no other point beats on both: lower TPOT and better quality."""
    sign = 1.0 if higher_is_better else -1.0
    best, out = -math.inf, []
    for p in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if sign * p[1] > best:
            out.append(p)
            best = sign * p[1]
    return out


def varies(values: list) -> bool:
    return len({round(v, 12) for v in values}) > 1


def pareto_points(task: str, metric: str, axes: list, groups: list) -> tuple[tuple, list]:
    """The speed measure and (speed, quality, configuration) of every group reporting both. Speed is TPOT,
    or TTFT where fewer than two configurations decode (a perplexity run only scores prompts)."""
    for speed in SPEEDS:
        pts = []
        for g in groups:
            fast, quality = _stats(g, speed[3], speed[4]), _stats(g, f"tasks.{task}.{metric}", 1.0)
            if fast and quality:
                pts.append((fast[0], quality[0], ", ".join(g.axes[a] for a in axes)))
        if len(pts) >= 2:
            break
    return speed, pts


def pareto_blocker(speed: tuple, pts: list, metric: str) -> Optional[str]:
    """Why a Pareto plot of ``pts`` would say nothing (None: it would)."""
    if len(pts) < 2:
        return f"fewer than two configurations report both a speed (TPOT or TTFT) and {metric}"
    if not varies([p[1] for p in pts]):
        return f"its {metric} is the same in every configuration (exact replays all carry their recording's scores)"
    if not varies([p[0] for p in pts]):
        return f"{speed[1]} is the same in every configuration"
    return None


def pareto_figure(task: str, metric: str, higher: bool, speed: tuple, axes: list, pts: list, path: Path) -> str:
    """Task quality against speed, one point per configuration, the frontier marked; returns the caption."""
    front = frontier(pts, higher)
    plt = _plt()
    with plt.rc_context(RC):
        fig, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
        # one marker per configuration, named in the legend (labels beside points collide when points do)
        markers = "osD^v<>ph*"
        colors = plt.get_cmap("tab10").colors
        for i, (x, y, name) in enumerate(pts):
            ax.scatter([x], [y], s=45, marker=markers[i // len(colors) % len(markers)], color=colors[i % len(colors)],
                       label=name, zorder=3)
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="black", lw=1.3, zorder=2,
                label="Pareto frontier")
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=160, facecolors="none", edgecolors="black",
                   lw=1.5, zorder=2)
        ax.margins(x=0.08, y=0.12)
        ax.set_xlabel(f"{speed[1]} ({speed[2]}, lower is better)")
        ax.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better)")
        ax.set_title(f"{task}: quality vs speed")
        ax.grid(alpha=0.3)
        fig.legend(loc="outside lower center", ncol=min(3, len(pts) + 1), frameon=False, title=", ".join(axes))
        _save(fig, path)
    return (f"{task} {metric} vs {speed[1]}, one point per configuration ({', '.join(axes)}); "
            f"ringed and joined: the Pareto frontier")


def draw_adhoc(sec, out: Path) -> tuple[list, list]:
    """The figures of an ad-hoc section: ([(file name, caption)], [note])."""
    from ...eval.harness import QUALITY

    ok = [g for g in sec.groups if g.ok]
    axes = list(sec.rows)
    notes = []
    if not ok:
        return [], ["no figures: no job finished"]
    if not axes:
        return [], ["no figures: no swept axis varies across the jobs (nothing to plot against)"]
    left = sum(j.status != "ok" for j in sec.jobs)
    if left:
        notes.append(f"{left} job(s) that did not finish are left out of every figure (listed below)")
    figures, prefix = [], slug(sec.spec.id)
    drawn = dict.fromkeys([m[0] for m in METRICS], 0)
    for metric in METRICS:  # one metric's figures side by side (the page puts two in a row)
        for axis in axes:
            name = f"{prefix}_{slug(axis)}_{metric[0]}.png"
            caption = axis_figure(axis, [a for a in axes if a != axis], metric, ok, out / name)
            if caption:
                figures.append((name, caption))
                drawn[metric[0]] += 1
    notes += [f"no {label} figures: no finished job reports {expr}" for key, label, _, expr, _ in METRICS
              if not drawn[key]]
    tasks = dict.fromkeys(t for g in ok for j in g.ok for t in (j.results.get("tasks") or {}) if t in QUALITY)
    if not tasks:
        notes.append("no Pareto plot: no job reports a task score")
    for task in tasks:
        metric, higher = QUALITY[task]
        name = f"{prefix}_pareto_{slug(task)}.png"
        speed, pts = pareto_points(task, metric, axes, ok)
        why = pareto_blocker(speed, pts, metric)
        if why:
            notes.append(f"no Pareto plot for {task}: {why}")
        else:
            figures.append((name, pareto_figure(task, metric, higher, speed, axes, pts, out / name)))
    return figures, notes

