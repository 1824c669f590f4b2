"""``specmd report``: the tables and figures of one or more sweeps, in their papers' layout.

    specmd report outputs/experiments/specmd_fig4/<time>          # one sweep
    specmd report outputs/experiments                              # the newest sweep of every experiment
    specmd report DIR... --wandb ENTITY/PROJECT                    # also log the report to a W&B run
    specmd report --wandb ENTITY/PROJECT --group specmd_fig4       # read the runs back from W&B instead

1. Find the sweeps and every job each was asked for (collect.py): finished, failed or missing.
2. Group each experiment's jobs by its ``report`` spec (tables.py): one section per report id, rows and
   column groups from its axes, mean ± std over repeat axes only; the spec's ``checks`` (the paper's
   direction claims) evaluated on those groups into verdicts (verdicts.py).
3. Write ``report.md`` and ``index.html`` (every section; one self-contained styled page, page.py),
   ``<id>.md``, ``<id>.csv`` (long format: one row per group and metric) and ``<id>_<n>.png`` per figure of
   the spec (figures.py) into ``--out``. A sweep without a spec (ad-hoc) gets each swept axis against hit
   rate, collision rate and TPOT, and a quality-vs-TPOT Pareto plot (adhoc.py).
4. With ``--wandb``: log the tables and figures to a W&B run of job type ``report`` (wandb_io.py); with
   ``--publish`` (online), also a W&B Report with one panel per table and figure.

The layout of a section comes from the experiment's ``report`` spec: the installed
``specmd/conf/experiment/<experiment>.yaml`` when it exists (so a fixed caption or figure applies to old sweeps;
the numbers always come from the jobs' results.json), else the copy in the sweep's ``multirun.yaml``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import CONF_DIR
from ..errors import ConfigError
from .collect import Sweep, find_sweeps, sweep_for_also, unfinished
from .tables import Spec, cell, group_jobs, table
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


def sections_of(sweeps: list) -> list:
    out: dict = {}
    for s in sweeps:
        spec = spec_of(s)
        sec = out.setdefault(spec.id, Section(spec, []))
        if s not in sec.sweeps:
            sec.sweeps.append(s)
        for name in spec.also:
            extra = sweep_for_also(sweeps, name, [x.dir for x in sweeps])
            if extra is not None and extra not in sec.sweeps:
                sec.sweeps.append(extra)
    for sec in out.values():
        sec.adhoc = not sec.spec.metrics and not sec.spec.figures
        if not sec.spec.metrics:
            sec.spec.metrics = default_metrics(sec.jobs)
        sec.groups, sec.rows = group_jobs(sec.spec, sec.jobs)
        sec.verdicts = verdicts(sec.spec, sec.groups)
        if sec.adhoc and not sec.spec.title and sec.rows:  # its id is a time stamp: say what was swept
            sec.spec.title = f"{sec.spec.id}: {' × '.join(sec.rows)}"
    return list(out.values())


def default_metrics(jobs: list) -> list:
    """An ad-hoc sweep (no ``report`` spec): the cache, the speed, and each task's headline metric."""
    from ..eval.harness import QUALITY

    metrics = [("hit %", "cache.hit_rate"), ("in-cache %", "cache.in_cache_rate"),
               ("collision %", "cache.collision_rate"), ("TTFT (ms)", "timing.ttft_s * 1000"),
               ("TPOT (ms)", "timing.tpot_s * 1000"), ("decode tok/s", "timing.decode_tokens_per_s")]
    tasks = dict.fromkeys(t for j in jobs if j.status == "ok" for t in (j.results.get("tasks") or {}))
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
            sec.figures.append((name, draw(spec, dict(fs), sec.groups, out / name)))
    if sec.adhoc:
        from .adhoc import draw_adhoc

        sec.figures, sec.notes = draw_adhoc(sec, out)
    for name, caption in sec.figures:
        lines += [f"![{caption}]({name})", ""]
    lines += [f"*Note: {n}.*" for n in sec.notes] + ([""] if sec.notes else [])
    bad = problems(sec)
    if bad:
        lines += [f"**Not finished ({len(bad)} of {len(sec.jobs)} jobs; left out of every number above):**", ""]
        lines += bad + [""]
    (out / f"{spec.id}.md").write_text("\n".join(lines) + "\n")
    rows_csv = csv_rows(sec)
    if rows_csv:
        keys = list(dict.fromkeys(k for r in rows_csv for k in r))
        with open(out / f"{spec.id}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(rows_csv)
    return lines


def build(paths: list, out: Optional[str] = None, sweeps: Optional[list] = None) -> tuple[Path, list]:
    """Write the report of ``paths`` (or of already-loaded ``sweeps``) into ``out``; returns (out, sections)."""
    notes: list = []
    if sweeps is None:
        sweeps, notes = find_sweeps(paths)
    if not sweeps:
        raise ConfigError("no sweeps to report")
    outp = Path(out) if out else Path(paths[0] if len(paths) == 1 else ".") / "report"
    outp.mkdir(parents=True, exist_ok=True)
    sections = sorted(sections_of(sweeps), key=lambda s: s.spec.id)
    lines = ["# specmd report", ""] + [f"- note: {n}" for n in notes] + ([""] if notes else [])
    for sec in sections:
        lines += write_section(sec, outp)
    (outp / "report.md").write_text("\n".join(lines) + "\n")
    from .page import write_html

    write_html(sections, notes, outp)  # after write_section: it shows the figures those drew
    return outp, sections


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="specmd report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="sweep directories, run directories, or parents of them")
    ap.add_argument("--out", help="output directory (default: <path>/report, or ./report for several paths)")
    ap.add_argument("--wandb", metavar="ENTITY/PROJECT", help="log the report to W&B (and read runs from there "
                    "when no paths are given)")
    ap.add_argument("--group", help="with --wandb and no paths: the W&B group (experiment) to read")
    ap.add_argument("--mode", default="auto", choices=["auto", "online", "offline"], help="W&B mode")
    ap.add_argument("--publish", action="store_true", help="with --wandb online: also save a W&B Report")
    args = ap.parse_args(argv)
    try:
        sweeps = None
        if not args.paths:
            if not args.wandb:
                ap.error("give sweep directories, or --wandb ENTITY/PROJECT to read runs from W&B")
            from .wandb_io import sweeps_from_wandb

            sweeps = sweeps_from_wandb(args.wandb, args.group)
        out, sections = build(args.paths, args.out, sweeps)
        if args.wandb:
            from .wandb_io import log_report

            url = log_report(sections, out, args.wandb, args.group, args.mode, args.publish)
            if url:
                print(f"W&B: {url}")
    except ConfigError as exc:
        print(f"specmd report: error: {exc}", file=sys.stderr)
        return 2
    for sec in sections:
        bad = sum(j.status != "ok" for j in sec.jobs)
        print(f"{sec.spec.id}: {len(sec.jobs) - bad}/{len(sec.jobs)} jobs" + (f" ({bad} not finished)" if bad else "")
              + f", {len(sec.figures)} figure(s)" + (f"; verdict: {summary(sec.verdicts)}" if sec.verdicts else ""))
    print(f"report: {out / 'index.html'}")
    return 0
