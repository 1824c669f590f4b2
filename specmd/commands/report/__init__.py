"""``specmd report``: the tables and figures of one or more sweeps, in their papers' layout.

    specmd report outputs/experiments/specmd_fig4/<time>          # one sweep
    specmd report outputs/experiments                              # the newest sweep of every experiment
    specmd report DIR... --wandb ENTITY/PROJECT                    # also log the report to a W&B run
    specmd report --wandb ENTITY/PROJECT --group specmd_fig4       # read the runs back from W&B instead

1. Find the sweeps and every job each was asked for (:mod:`specmd.sweeps`): finished, failed or missing.
2. Group each experiment's jobs by its ``report`` spec (tables.py): one section per report id, rows and
   column groups from its axes, mean ± std over repeat axes only; the spec's ``checks`` (the paper's
   direction claims) evaluated on those groups into verdicts (verdicts.py).
3. Write ``report.md`` and ``index.html`` (every section; one self-contained styled page, page.py),
   ``<id>.md``, ``<id>.csv`` (long format: one row per group and metric) and ``<id>_<n>.png`` per figure of
   the spec (figures.py) into ``--out``. A sweep without a spec (ad-hoc) gets each swept axis against hit
   rate, collision rate and TPOT, and a quality-vs-TPOT Pareto plot (adhoc.py).
4. With ``--wandb``: log the tables and figures to a W&B run of job type ``report`` (wandb_io.py); with
   ``--publish`` (online), also a W&B Report with one panel per table and figure.

Nothing it cannot read is a traceback, and nothing it reads is judged silently: a job directory it cannot
read is skipped and named (:mod:`specmd.sweeps`); a value in a results.json that is no finite number (NaN, Infinity, a
string) is named with its file and key (``specmd report: <file>: cache.hit_rate is NaN``, on stderr and in
the report), left out of every number, and a check that needed it is "not measured" with that reason; runs
whose resolved configs differ in a key no axis names (two sweeps on two models) are kept apart, never averaged
as repeats (tables.config_split), and the section says so. ``--out`` must be a directory it can write (or
create): anything else is an error naming it before any work; every file it writes stays inside it, named by
the section id, which must be a plain file name.

The layout of a section comes from the experiment's ``report`` spec: the installed
``specmd/conf/experiment/<experiment>.yaml`` when it exists (so a fixed caption or figure applies to old sweeps;
the numbers always come from the jobs' results.json), else the copy in the sweep's ``multirun.yaml``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ... import CONF_DIR
from ...errors import ConfigError
from ...results import writable_dir, write_csv, write_text_atomic
from ...sweeps import Sweep, find_sweeps, sweep_for_also, unfinished
from .tables import Spec, cell, config_split, group_jobs, row_axes, split_note, table
from .verdicts import markdown as verdict_lines
from .verdicts import parse_spec, summary, verdicts

CONF_EXPERIMENTS = Path(CONF_DIR) / "experiment"


@dataclass
class Section:
    spec: Spec
    sweeps: list
    groups: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    figures: list = field(default_factory=list)  # [(file name, caption)]
    adhoc: bool = False  # no report spec of its own (python -m specmd -m ... without +experiment=)
    notes: list = field(default_factory=list)  # what the figures could not show, and why
    pooling: list = field(default_factory=list)  # what its runs' configs differ in beyond the axes (kept apart)
    split_axes: list = field(default_factory=list)  # the config keys that keep them apart (row axes)
    verdicts: list = field(default_factory=list)  # [verdicts.Verdict]: the spec's checks on these groups

    @property
    def jobs(self) -> list:
        return [j for s in self.sweeps for j in s.jobs]


def spec_of(sweep: Sweep) -> Spec:
    conf = CONF_EXPERIMENTS / f"{sweep.experiment}.yaml"
    raw = sweep.spec
    if conf.exists():
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(OmegaConf.load(conf)).get("report") or raw
    return parse_spec(raw, sweep.experiment)


SECTION_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def section_id(spec: Spec, sweep: Sweep) -> str:
    """The section's id, which names its files (``<id>.md``, ``<id>.csv``, ``<id>_<n>.png``): a plain file
    name, so every file stays in ``--out``. An id from a directory name (a sweep without an experiment) is made
    one; an experiment's (or ``report.id``) that is none is an error naming it."""
    sid = spec.id
    if SECTION_ID.fullmatch(sid) and sid not in (".", ".."):
        return sid
    if not (sweep.spec.get("id") or sweep.experiment != Path(sweep.dir).name):  # the directory's name
        from .adhoc import slug

        return slug(sid)
    raise ConfigError(f"{sweep.dir}: report id {sid!r} (its experiment or report.id) names the report's files: "
                      "it must be a plain name of letters, digits and _ . - (no path separator, no "
                      "override syntax such as + = , [ ] or spaces)")


def sections_of(sweeps: list, notes: Optional[list] = None) -> list:
    out: dict = {}
    notes = notes if notes is not None else []
    for s in sweeps:
        spec = spec_of(s)
        spec.id = section_id(spec, s)
        sec = out.setdefault(spec.id, Section(spec, []))
        if s not in sec.sweeps:
            sec.sweeps.append(s)
        for name in spec.also:
            extra = sweep_for_also(sweeps, name, [x.dir for x in sweeps], notes)
            if extra is not None and extra not in sec.sweeps:
                sec.sweeps.append(extra)
    for sec in out.values():
        sec.adhoc = not sec.spec.metrics and not sec.spec.figures
        if not sec.spec.metrics:
            sec.spec.metrics = default_metrics(sec.jobs)
        sec.groups, sec.rows = group_jobs(sec.spec, sec.jobs)
        spec = sec.spec
        split = config_split(spec, sec.jobs, row_axes(spec, sec.jobs) + ([spec.cols] if spec.cols else []))
        note = split_note(split)
        sec.pooling, sec.split_axes = ([note] if note else []), list(split.axes)
        sec.verdicts = verdicts(sec.spec, sec.groups)
        if sec.adhoc and not sec.spec.title and sec.rows:  # its id is a time stamp: say what was swept
            sec.spec.title = f"{sec.spec.id}: {' × '.join(sec.rows)}"
    return list(out.values())


def default_metrics(jobs: list) -> list:
    """An ad-hoc sweep (no ``report`` spec): the cache, the speed, and each task's headline metric."""
    from ...eval.harness import QUALITY

    metrics = [("hit %", "cache.hit_rate"), ("in-cache %", "cache.in_cache_rate"),
               ("collision %", "cache.collision_rate"), ("TTFT (ms)", "timing.ttft_s * 1000"),
               ("TPOT (ms)", "timing.tpot_s * 1000"), ("decode tok/s", "timing.decode_tokens_per_s")]
    ok = [j for j in jobs if j.status == "ok"]
    # beside the realized hit rate, the oracle's (Belady on the same requests), and each step's union against
    # independent routing: where any run has them (a replay; a live run that recorded its routing)
    cache = [j.results.get("cache") or {} for j in ok]
    if any((c.get("oracle") or {}).get("hit_rate") is not None for c in cache):
        metrics.insert(1, ("oracle hit %", "cache.oracle.hit_rate"))
    steps = [((c.get("union") or {}).get("decode") or {}).get("tokens_per_step") for c in cache]
    if any(isinstance(s, (int, float)) and not isinstance(s, bool) and s > 1 for s in steps):
        metrics += [("decode batch", "cache.union.decode.tokens_per_step"),
                    ("experts/layer/step", "cache.union.decode.distinct_per_layer.mean"),
                    ("independent", "cache.union.decode.independent_per_layer")]
    tasks = dict.fromkeys(t for j in ok if isinstance(j.results.get("tasks"), dict) for t in j.results["tasks"])
    for task in tasks:
        if task in QUALITY:
            metrics.append((f"{task} {QUALITY[task][0]}", f"tasks.{task}.{QUALITY[task][0]}"))
    return metrics


# --- tables -------------------------------------------------------------------------------------------

def markdown_table(header: list, rows: list) -> list:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(esc, r)) + " |" for r in rows]


def problems(sec: Section) -> list:
    """One markdown line per job that did not finish: never averaged over, always shown."""
    return [f"- **{status}** {what}" for status, what in unfinished(sec.sweeps)]


def bad_values(sec: Section) -> list:
    """``<file>: cache.hit_rate is NaN``: each value of a finished job's results.json that is no finite number
    (read by the section, or anywhere non-finite): left out of every number and figure."""
    return [f"{j.file}: {key} is {why}" for j in sec.jobs for key, why in j.problems.items()]


def warnings_of(sections: list, notes: list) -> list:
    """Every warning of a report, once: directories and files that could not be read, then bad values."""
    out = list(notes)
    for sec in sections:
        for s in sec.sweeps:
            out += s.warnings
        out += bad_values(sec)
    return list(dict.fromkeys(out))


def _inside(out: Path, name: str) -> Path:
    """``out / name``, which must be a file directly in ``out`` (a section id is checked to be a plain name;
    this keeps every write in the directory the user named, whatever a later change names files after)."""
    target = out / name
    if target.parent.resolve() != out.resolve() or name in ("", ".", ".."):
        raise ConfigError(f"report file {name!r} would be written outside {out}: a report file name is a plain "
                          "name (no path separator)")
    return target


def output_dir(paths: list, out: Optional[str]) -> Path:
    """The report's directory: ``--out``, else ``<path>/report`` (one path) or ``./report``; a ConfigError
    naming it when it cannot be one (an existing file, a path under a file, a directory not writable), checked
    before any work."""
    outp = Path(out) if out else Path(paths[0] if len(paths) == 1 else ".") / "report"
    what = f"--out {outp}" if out else f"the report directory (--out's default) {outp}"
    return writable_dir(outp, what)


def _make_dir(outp: Path) -> None:
    try:
        outp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"report directory {outp}: cannot be created ({exc.strerror or exc})") from None


def csv_rows(sec: Section) -> list:
    spec = sec.spec
    axes = sec.rows + ([spec.cols] if spec.cols else [])
    out = []
    for g in sec.groups:
        for label, expr in spec.metrics:
            mean, sd, n = cell(spec, label, expr, g, sec.groups) if g.status() == "ok" else (None, None, 0)
            out.append({"section": spec.id, **{a: g.axes[a] for a in axes}, "metric": label, "mean": mean,
                        "std": sd, "n": n, "status": g.status(), "jobs": len(g.jobs)})
    return out


# --- the report ---------------------------------------------------------------------------------------

def write_section(sec: Section, out: Path) -> list:
    from .figures import draw

    spec = sec.spec
    lines = [f"## {spec.title or spec.id}", "", f"`{spec.id}` · sweeps: " + ", ".join(f"`{s.dir}`" for s in sec.sweeps)]
    ok = sum(j.status == "ok" for j in sec.jobs)
    lines += [f"· {ok}/{len(sec.jobs)} jobs finished", ""]
    if spec.paper:
        lines += [f"**Paper:** {spec.paper}", ""]
    lines += verdict_lines(sec.verdicts)
    header, rows = table(sec)
    lines += markdown_table(header, rows) + [""]
    sec.figures, sec.notes = [], []
    for i, fs in enumerate(spec.figures, 1):
        name = f"{spec.id}_{i}.png"
        if any(g.ok for g in sec.groups):
            if not isinstance(fs, dict):
                raise ConfigError(f"report.figures[{i - 1}] of {spec.id}: a mapping (kind: bars, x: ..., y: ...), "
                                  f"not {fs!r}")
            sec.figures.append((name, draw(spec, dict(fs), sec.groups, _inside(out, name))))
    if sec.adhoc:
        from .adhoc import draw_adhoc

        sec.figures, sec.notes = draw_adhoc(sec, out)
    for name, caption in sec.figures:
        _inside(out, name)
        lines += [f"![{caption}]({name})", ""]
    bad = bad_values(sec)  # after the table and the figures: the values they read are recorded
    if bad:
        sec.notes.append("values that are no finite number, left out of every number and figure: " + "; ".join(bad))
    sec.notes[:0] = sec.pooling
    lines += [f"*Note: {n}.*" for n in sec.notes] + ([""] if sec.notes else [])
    bad = problems(sec)
    if bad:
        lines += [f"**Not finished ({len(bad)} of {len(sec.jobs)} jobs; left out of every number above):**", ""]
        lines += bad + [""]
    write_text_atomic(_inside(out, f"{spec.id}.md"), "\n".join(lines) + "\n")
    rows_csv = csv_rows(sec)
    if rows_csv:
        write_csv(_inside(out, f"{spec.id}.csv"), rows_csv)
    return lines


def build(paths: list, out: Optional[str] = None, sweeps: Optional[list] = None,
          warnings: Optional[list] = None) -> tuple[Path, list]:
    """Write the report of ``paths`` (or of already-loaded ``sweeps``) into ``out``; returns (out, sections).
    ``warnings``: extended with what could not be read or was no number (:func:`warnings_of`)."""
    notes: list = []
    outp = output_dir(paths, out)  # before any work
    if sweeps is None:
        sweeps, notes = find_sweeps(paths)
    if not sweeps:
        raise ConfigError("no sweeps to report")
    sections = sorted(sections_of(sweeps, notes), key=lambda s: s.spec.id)
    _make_dir(outp)
    body = []
    for sec in sections:
        body += write_section(sec, outp)
    every = warnings_of(sections, notes)
    if warnings is not None:
        warnings += every
    notes = [n for n in every if not any(n in b for sec in sections for b in sec.notes)]
    lines = ["# specmd report", ""] + [f"- note: {n}" for n in notes] + ([""] if notes else []) + body
    write_text_atomic(_inside(outp, "report.md"), "\n".join(lines) + "\n")
    from .page import write_html

    write_html(sections, notes, outp)  # after write_section: it shows the figures those drew
    return outp, sections


def main(argv: Optional[list] = None) -> int:
    from ...errors import ArgumentParser

    ap = ArgumentParser(prog="specmd report", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="sweep directories, run directories, or parents of them")
    ap.add_argument("--out", help="output directory (default: <path>/report, or ./report for several paths)")
    ap.add_argument("--wandb", metavar="ENTITY/PROJECT", help="log the report to W&B (and read runs from there "
                    "when no paths are given)")
    ap.add_argument("--group", help="with --wandb and no paths: the W&B group (experiment) to read")
    ap.add_argument("--mode", default="auto", choices=["auto", "online", "offline"], help="W&B mode")
    ap.add_argument("--publish", action="store_true", help="with --wandb online: also save a W&B Report")
    args = ap.parse_args(argv)
    if args.publish and not args.wandb:
        raise ConfigError("--publish saves a W&B Report: it needs --wandb ENTITY/PROJECT")
    if args.group and args.paths:
        raise ConfigError(f"--group {args.group} selects the W&B runs to read when no paths are given; with paths "
                          "the runs are the paths' (drop --group, or the paths)")
    sweeps = None
    output_dir(args.paths, args.out)  # a path it cannot write is an error before any work (W&B included)
    if not args.paths:
        if not args.wandb:
            ap.error("give sweep directories, or --wandb ENTITY/PROJECT to read runs from W&B")
        from .wandb_io import sweeps_from_wandb

        sweeps = sweeps_from_wandb(args.wandb, args.group)
    warnings: list = []
    out, sections = build(args.paths, args.out, sweeps, warnings)
    if args.wandb:
        from .wandb_io import log_report

        url = log_report(sections, out, args.wandb, args.group, args.mode, args.publish)
        if url:
            print(f"W&B: {url}")
    for w in warnings:
        print(f"specmd report: {w}", file=sys.stderr)
    for sec in sections:
        bad = sum(j.status != "ok" for j in sec.jobs)
        split = sec.split_axes
        print(f"{sec.spec.id}: {len(sec.jobs) - bad}/{len(sec.jobs)} jobs" + (f" ({bad} not finished)" if bad else "")
              + (f", kept apart by config key(s) {', '.join(split)}" if split else "")
              + f", {len(sec.figures)} figure(s)" + (f"; verdict: {summary(sec.verdicts)}" if sec.verdicts else ""))
    print(f"report: {out / 'index.html'}")
    return 0
