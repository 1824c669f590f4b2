"""Step 2 of a report: an experiment's ``report`` section (its spec) applied to its jobs -> grouped values.

The spec lives beside the sweep in the experiment config (specmd/conf/experiment/<name>.yaml), so an experiment's
axes and its paper's layout have one home::

    report:
      id: specmd_fig6              # sections merge the sweeps that share an id (default: the experiment)
      title: ...                   # the caption
      paper: ...                   # the paper's numbers, quoted beside ours
      rows: [eviction.name]        # axes naming a table row (an override key or a config path)
      cols: hardware.capacity      # optional axis pivoted into column groups
      repeat: [eval.seed]          # axes averaged as mean ± std (default: eval.seed, model.seed)
      baseline: {miss.name: fetch} # the group rel: metrics compare with ...
      match: [system]              # ... among the groups that share these axes
      also: [cce_fig4_cache_prior] # other experiments whose newest sweep this section also reads
      metrics:                     # table columns in order; a label holding % shows the value x 100
        - collision %: cache.collision_rate
      figures: [...]               # see figures.py
      checks: [...]                # the paper's direction claims, computed into verdicts: see verdicts.py

Every swept axis not named in rows, cols or repeat becomes a row axis too: runs are averaged only over the
``repeat`` axes, never silently over anything else. Nor over a difference of their *resolved configs* that no
override names (two sweeps of one experiment run on different models, the model set by the experiment or a
default changed between them): a config key that tells apart runs the axes would pool becomes a row axis
(:func:`config_split`; ``<group>.name`` keys first, then the shallowest), and the section's notes name every
key that differed. Keys that change no number are left out: :data:`specmd.jobs.UNHASHED` (logger, threads,
data), the report spec itself, the experiment's name, and the repeat axes.

The metrics are expressions over the jobs' results (:mod:`.expressions`: their grammar, and what a value that is
no finite number does).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from ...errors import ConfigError
from ...loggers import flatten
from .expressions import job_value, lookup, numeric, split_prefix

DEFAULT_REPEAT = ["eval.seed", "model.seed"]
MISSING = "-"


@dataclass
class Spec:
    id: str
    title: str = ""
    paper: str = ""
    rows: list = field(default_factory=list)
    cols: Optional[str] = None
    repeat: list = field(default_factory=lambda: list(DEFAULT_REPEAT))
    baseline: dict = field(default_factory=dict)
    match: list = field(default_factory=list)
    also: list = field(default_factory=list)
    metrics: list = field(default_factory=list)  # [(label, expression)]
    figures: list = field(default_factory=list)
    checks: list = field(default_factory=list)  # [verdicts.Check] after verdicts.parse_spec: the paper's claims, computed

    @classmethod
    def parse(cls, raw: dict, experiment: str) -> "Spec":
        raw = dict(raw or {})
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(raw) - known)
        if bad:
            raise ConfigError(f"report section of {experiment}: unknown key(s) {bad}; valid: {', '.join(sorted(known))}")
        metrics = []
        for m in raw.pop("metrics", None) or []:
            if not (isinstance(m, dict) and len(m) == 1):
                raise ConfigError(f"report.metrics of {experiment}: {m!r} must be one 'label: expression' pair")
            (label, expr), = m.items()
            metrics.append((str(label), str(expr)))
        base = raw.pop("baseline", None) or {}
        raw["baseline"] = flatten(base)  # a spec read back from W&B arrives un-flattened: {miss: {name: fetch}}
        spec = cls(id=str(raw.pop("id", None) or experiment), metrics=metrics, **raw)
        spec.rows = list(spec.rows or [])
        spec.repeat = list(spec.repeat if spec.repeat is not None else DEFAULT_REPEAT)
        spec.checks = list(spec.checks or [])  # as written: verdicts.parse_spec parses them (it imports this module)
        return spec


def axis_value(job, key: str) -> str:
    """An axis of a job: its override value when the key was overridden (``eviction.name`` reads a group
    override ``eviction=lru``), else the config's value (a policy group's ``name`` for a group key such as
    ``eviction``); ``-`` when the config has no such key."""
    axes = job.axes
    if key in axes:
        return axes[key]
    if key.endswith(".name") and key[:-5] in axes:
        return axes[key[:-5]]
    v = lookup(job.config or (job.results or {}).get("config") or {}, key)
    if isinstance(v, dict):
        v = v.get("name", MISSING)
    return MISSING if v is None else str(v)


# --- groups -------------------------------------------------------------------------------------------

@dataclass
class Group:
    axes: dict  # axis -> value string (rows and cols)
    jobs: list = field(default_factory=list)

    @property
    def ok(self) -> list:
        return [j for j in self.jobs if j.status == "ok"]

    def values(self, expr: str) -> list:
        """The finished jobs' values (a value that is no finite number recorded on its job, left out)."""
        return [v for v in (job_value(j, expr) for j in self.ok) if v is not None]

    def mean(self, expr: str):
        vals = [v for v in self.values(expr) if numeric(v)]
        return statistics.fmean(vals) if vals else None

    def status(self) -> str:
        if self.ok:
            return "ok"
        return "failed" if any(j.status == "failed" for j in self.jobs) else "missing"


def _covered(key: str, named: list) -> bool:
    """A swept override key is named by the spec when it is named exactly, or as its group's ``.name``
    (``eviction`` <-> ``eviction.name``); ``model.seed`` does not cover a ``model`` sweep."""
    return any(n == key or n == key + ".name" or key == n + ".name" for n in named)


def row_axes(spec: Spec, jobs: list) -> list:
    """The spec's rows, plus every swept axis it does not name (never averaged silently)."""
    named = spec.rows + ([spec.cols] if spec.cols else []) + spec.repeat + ["experiment"]  # the section itself
    varying = []
    for j in jobs:
        for k in j.axes:
            if k not in varying and len({jj.axes.get(k) for jj in jobs}) > 1 and not _covered(k, named):
                varying.append(k)
    return spec.rows + varying


# config keys that change no number (specmd.jobs.UNHASHED), the spec itself, the experiment's name (two
# experiments drawn into one section by ``also`` run one config when nothing else differs), W&B's bookkeeping
NO_NUMBERS = ("logger", "threads", "data", "report", "experiment", "hydra", "hydra_overrides", "sweep_dir",
              "job_type", "provenance")


def _leaf(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, dict)):
        import json

        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def _flat_config(config: Any, prefix: str = "") -> dict:
    """Dotted key -> value text of a config's leaves (a list is one leaf)."""
    out: dict = {}
    if not isinstance(config, dict):
        return out
    for k, v in config.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flat_config(v, key))
        else:
            out[key] = _leaf(v)
    return out


def _under(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") or (n.endswith(".name") and key.startswith(n[:-4]))
               for n in names)


def _known_config(job) -> dict:
    """The config values of ``job`` that are known to be its own: all of a config it wrote (results.json,
    failed.json); of its sweep's config (a job that never wrote one), the keys its overrides do not set."""
    from ...jobs import UNHASHED

    flat = {k: v for k, v in _flat_config(job.config).items()
            if k.split(".", 1)[0] not in NO_NUMBERS + tuple(UNHASHED) and not k.startswith("_")}
    if not getattr(job, "own_config", True):
        own = list(job.axes)
        flat = {k: v for k, v in flat.items() if not _under(k, own)}
    return flat


@dataclass
class ConfigSplit:
    """What :func:`config_split` found: the config keys added as row axes, each job's values of them, and
    every key that differed between runs the axes alone would pool (key -> its values, in first-seen order)."""
    axes: list
    values: dict  # id(job) -> {key: value}
    differ: dict


def config_split(spec: Spec, jobs: list, axes: list) -> ConfigSplit:
    """The config keys that tell apart runs whose ``axes`` values are equal and that the repeat axes do not
    name: those runs are no repeats of one configuration. Greedily, ``<group>.name`` keys first, then the
    shallowest, a key is added when it splits a group the axes (and the keys added so far) would form; a job
    whose value of it is unknown (it never wrote its config, and its overrides set that key) takes its
    group's value when the group has one, else ``-``."""
    known = [(j, _known_config(j)) for j in jobs]
    keys = list(dict.fromkeys(k for _, flat in known for k in flat))
    named = set(axes)
    keys = [k for k in keys if not _under(k, spec.repeat) and not _covered(k, list(named))]

    def value(j, flat, k):
        if k in flat:
            return flat[k]
        if not getattr(j, "own_config", True) and _under(k, list(j.axes)):
            return None  # unknown: set by an override of a job that wrote no config
        return MISSING

    part = {id(j): tuple(axis_value(j, a) for a in axes) for j in jobs}
    base = dict(part)

    def splits(k, of: dict) -> dict:
        seen: dict = {}
        for j, flat in known:
            v = value(j, flat, k)
            if v is not None:
                seen.setdefault(of[id(j)], {})[v] = None
        return seen

    differ = {}
    for k in keys:
        seen = splits(k, base)
        if any(len(vs) > 1 for vs in seen.values()):
            differ[k] = list(dict.fromkeys(v for vs in seen.values() if len(vs) > 1 for v in vs))
    order = sorted(differ, key=lambda k: (not k.endswith(".name"), k.count("."), keys.index(k)))
    added, values = [], {id(j): {} for j in jobs}
    for k in order:
        seen = splits(k, part)
        if not any(len(vs) > 1 for vs in seen.values()):
            continue  # the keys added so far already tell these runs apart
        added.append(k)
        for j, flat in known:
            v = value(j, flat, k)
            if v is None:
                vs = list(seen.get(part[id(j)], {}))
                v = vs[0] if len(vs) == 1 else MISSING
            values[id(j)][k] = v
            part[id(j)] += (v,)
    return ConfigSplit(added, values, differ)


def split_note(split: ConfigSplit) -> Optional[str]:
    """The section's note on what its runs' configs differ in beyond the table's axes (None: nothing)."""
    if not split.differ:
        return None

    def vals(k):
        vs = split.differ[k]
        return ", ".join(vs[:4]) + (f", … ({len(vs)} values)" if len(vs) > 4 else "")

    shown = list(split.differ)[:6]
    more = len(split.differ) - len(shown)
    return ("runs of these sweeps differ in their resolved config beyond the table's axes and overrides: "
            + "; ".join(f"{k} ({vals(k)})" for k in shown) + (f"; and {more} more key(s)" if more else "")
            + f". They are no repeats of one configuration: kept apart by {', '.join(split.axes)} (a row axis),"
              " never averaged together, and each check is judged for each value")


def group_jobs(spec: Spec, jobs: list) -> tuple[list, list]:
    """Groups in first-seen order (the sweep's order), and the row axes used: the spec's, every swept axis it
    does not name, and every config key that tells runs apart (:func:`config_split`)."""
    rows = row_axes(spec, jobs)
    cols = [spec.cols] if spec.cols else []
    split = config_split(spec, jobs, rows + cols)
    rows = rows + split.axes
    axes = rows + cols
    groups: dict = {}
    for j in jobs:
        key = tuple(split.values[id(j)][a] if a in split.axes else axis_value(j, a) for a in axes)
        groups.setdefault(key, Group(dict(zip(axes, key)))).jobs.append(j)
    # axes whose value is "-" in every group tell nothing (a row axis of another half of a merged figure)
    rows = [a for a in rows if any(g.axes[a] != MISSING for g in groups.values())]
    return list(groups.values()), rows


def unnamed_axes(spec: Spec, groups: list) -> list:
    """The axes of the groups that the spec does not name and that take several values (a swept override the
    spec leaves out, a config key that tells runs apart): a check is judged at each of their values, and a
    figure draws each value apart."""
    named = spec.rows + ([spec.cols] if spec.cols else [])
    axes = list(dict.fromkeys(a for g in groups for a in g.axes if a not in named))
    return [a for a in axes if len({g.axes.get(a) for g in groups}) > 1]


def baseline_of(spec: Spec, group: Group, groups: list) -> Optional[Group]:
    """The group ``group``'s rel: metrics compare with: the one holding the ``baseline`` values and sharing
    ``group``'s values of the ``match`` axes (default: every row and column axis the baseline does not fix,
    so an extra swept axis compares within its own value)."""
    match = spec.match or [a for a in group.axes if a not in spec.baseline]
    for g in groups:
        if all(g.axes.get(k, axis_value(g.jobs[0], k)) == str(v) for k, v in spec.baseline.items()) and all(
                g.axes.get(m) == group.axes.get(m) for m in match):
            return g
    return None


def cell(spec: Spec, label: str, expr: str, group: Group, groups: list) -> tuple[Optional[float], Optional[float], int]:
    """(mean, std or None, n) of one metric for one group; rel: metrics against the group's baseline."""
    prefix, inner = split_prefix(expr)
    vals = [v for v in group.values(inner) if numeric(v)]
    if not vals:
        return None, None, 0
    if prefix:
        base = baseline_of(spec, group, groups)
        b = base.mean(inner) if base is not None else None
        if not b:
            return None, None, len(vals)
        vals = [relative(prefix, v, b) for v in vals]
        vals = [v for v in vals if v is not None]
        if not vals:
            return None, None, 0
    scale = 100.0 if is_percent(label) else 1.0
    vals = [v * scale for v in vals]
    sd = statistics.stdev(vals) if len(vals) > 1 else None
    return statistics.fmean(vals), sd, len(vals)


def is_percent(label: str) -> bool:
    """A column whose label holds ``%`` shows its value x 100 (``hit %``, ``miss % of router requests``)."""
    return "%" in label


def relative(prefix: str, v: float, b: float) -> Optional[float]:
    """``rel:`` v/b - 1 (a gain), ``rel-:`` b/v - 1 (a gain where lower is better: perplexity, time),
    ``reduction:`` 1 - v/b (SpecMD Table 2's "TTFT reduction")."""
    if prefix == "rel:":
        return v / b - 1
    if prefix == "rel-:":
        return b / v - 1 if v else None
    return 1 - v / b


def fmt(mean, sd, n, percent: bool, total: Optional[int] = None) -> str:
    """``mean``, ``mean ± std (n=N)`` over repeats, and ``(n of total)`` when some of the group's jobs did
    not finish (the value stands on fewer runs than asked for)."""
    if mean is None:
        return MISSING
    partial = f" ({n} of {total} runs)" if total is not None and n < total else ""

    def one(x):
        if percent:
            return f"{x:.1f}"
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}" if abs(x) < 1e9 else f"{x:.3e}"

    return (one(mean) if sd is None else f"{one(mean)} ± {one(sd)} (n={n})") + partial


def sort_key(value: str):
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def table(sec) -> tuple[list, list]:
    """(header, rows) of a report section's table (``specmd.commands.report.Section``): row axes, then each metric (per column value when pivoted)."""
    spec = sec.spec
    cols = list(dict.fromkeys(g.axes[spec.cols] for g in sec.groups)) if spec.cols else [None]  # sweep order
    header = list(sec.rows)
    for c in cols:
        for label, _ in spec.metrics:
            header.append(label if c is None else f"{label} @ {spec.cols}={c}")
    if not spec.metrics:
        header.append("status")
    rows, seen = [], {}
    for g in sec.groups:
        key = tuple(g.axes[a] for a in sec.rows)
        seen.setdefault(key, {})[g.axes.get(spec.cols) if spec.cols else None] = g
    for key, by_col in seen.items():
        line = list(key)
        for c in cols:
            g = by_col.get(c)
            for label, expr in spec.metrics:
                if g is None:
                    line.append("not run")
                elif g.status() != "ok":
                    line.append(g.status())
                else:
                    line.append(fmt(*cell(spec, label, expr, g, sec.groups), is_percent(label),
                                    len(g.jobs)))
            if not spec.metrics:
                line.append(g.status() if g else "not run")
        rows.append(line)
    return header, rows
