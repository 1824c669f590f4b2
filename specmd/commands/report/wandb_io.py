"""Step 4 of a report: W&B in both directions.

* :func:`sweeps_from_wandb` reads the runs of a project (one group = one experiment, as ``logger=wandb``
  logs them) back through ``wandb.Api`` into the same sweeps a directory gives: config (un-flattened),
  summary (un-flattened into results.json's sections), the job's overrides, and its state (finished ->
  ok; failed/crashed -> failed; anything else -> missing). Runs are regrouped into their multiruns
  (config ``sweep_dir``) and only the newest multirun of each experiment is read. A job that never
  started has no W&B run: jobs missing from a sweep are only seen from its directory.
* :func:`log_report` logs a report's tables (``<id>/table``) and figures (``<id>/figure_<n>``) to a W&B run
  of job type ``report`` -- browsable in the UI like any run -- plus the whole report directory as an
  artifact; with ``publish`` (online only) it also saves a W&B Report (``wandb-workspaces``) with one
  panel per table and figure, reading that run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from ...errors import ConfigError
from ...sweeps import Job, Sweep, newest_per_experiment

STATES = {"finished": "ok", "failed": "failed", "crashed": "failed", "killed": "failed"}


def _split_path(path: str) -> tuple[Optional[str], str]:
    parts = path.strip("/").split("/")
    if len(parts) == 1:
        return None, parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise ConfigError(f"--wandb {path!r}: expected ENTITY/PROJECT or PROJECT")


def unflatten_config(flat: dict) -> dict:
    """``{"eviction.name": "lru"}`` -> ``{"eviction": {"name": "lru"}}`` (provenance left out)."""
    out: dict = {}
    for key, value in flat.items():
        if key.startswith(("provenance.", "_")):
            continue
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return out


def unflatten_summary(summary: dict) -> dict:
    """The inverse of :func:`specmd.loggers.flat_summary`: ``cache/hit_rate``, ``tasks/<task>/<metric>`` (a
    metric name may hold ``/``), ``cache/per_layer/<name>`` lists, ``analysis/<name>/<key>``..."""
    out: dict = {}
    for key, value in summary.items():
        if key.startswith("_"):
            continue
        head, _, rest = key.partition("/")
        if not rest:
            continue
        if head == "tasks":
            task, _, metric = rest.partition("/")
            out.setdefault("tasks", {}).setdefault(task, {})[metric] = value
            continue
        node = out.setdefault(head, {})
        parts = rest.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def sweeps_from_wandb(path: str, group: Optional[str] = None, api=None) -> list:
    """The runs of ``path`` (ENTITY/PROJECT), optionally of one group, as sweeps (one per experiment)."""
    import wandb

    entity, project = _split_path(path)
    api = api or wandb.Api()
    runs = api.runs(f"{entity}/{project}" if entity else project, filters={"group": group} if group else {})
    sweeps: dict = {}  # (experiment, sweep_dir) -> Sweep
    for run in runs:
        config = dict(run.config)
        if config.get("job_type") == "report" or getattr(run, "job_type", None) == "report":
            continue
        results = unflatten_summary(dict(run.summary))
        results["config"] = unflatten_config(config)
        overrides = list(config.get("hydra_overrides") or [])
        status = STATES.get(getattr(run, "state", "finished"), "missing")
        exp = str(results["config"].get("experiment") or getattr(run, "group", None) or group or project)
        job = Job(overrides, status, f"wandb:{run.id}", results if status == "ok" else {},
                  None if status == "ok" else f"W&B state {run.state}", config=results["config"])
        sweep_dir = str(config.get("sweep_dir") or "")
        sw = sweeps.setdefault((exp, sweep_dir), Sweep(f"wandb:{path}:{sweep_dir or exp}", exp,
                                                       dict(results["config"].get("report") or {}), []))
        sw.jobs.append(job)
        created = str(getattr(run, "created_at", "") or "")
        sw.time = max(sw.time, _epoch(created))
    if not sweeps:
        raise ConfigError(f"--wandb {path}: no runs" + (f" in group {group!r}" if group else ""))
    return newest_per_experiment(list(sweeps.values()))  # as with a parent directory


def _epoch(created: str) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def log_report(sections: list, out: Path, path: str, group: Optional[str], mode: str = "auto",
               publish: bool = False, wandb_module=None) -> Optional[str]:
    """Log the report (tables, figures, the directory as an artifact) to a W&B run; returns its URL (or a
    published Report's URL)."""
    import wandb as _wandb

    from ...loggers import WandbLogger
    from .tables import table

    wandb = wandb_module or _wandb
    entity, project = _split_path(path)
    mode = WandbLogger(project=project, entity=entity, mode=mode)._mode()
    ids = [s.spec.id for s in sections]
    name = f"report {' '.join(ids)} {time.strftime('%Y-%m-%d_%H-%M-%S')}"
    run = wandb.init(project=project, entity=entity, mode=mode, job_type="report", name=name,
                     group=group or (ids[0] if len(ids) == 1 else "report"), dir=str(out),
                     config={"sections": ids, "sweeps": sorted({s.dir for sec in sections for s in sec.sweeps})},
                     reinit="finish_previous")
    payload = {}
    for sec in sections:
        header, rows = table(sec)
        payload[f"{sec.spec.id}/table"] = wandb.Table(columns=[str(h) for h in header], data=[[str(c) for c in r]
                                                                                               for r in rows])
        for i, (fname, caption) in enumerate(sec.figures, 1):
            payload[f"{sec.spec.id}/figure_{i}"] = wandb.Image(str(out / fname), caption=caption)
    run.log(payload)
    art = wandb.Artifact(f"specmd-report-{'-'.join(ids)}"[:120], type="report")
    for f in sorted(out.iterdir()):  # the report's files; not the wandb/ run directories beside them
        if f.is_file():
            art.add_file(str(f))
    run.log_artifact(art)
    url = getattr(run, "url", None)
    run.finish()
    if publish:
        if mode != "online":
            raise ConfigError("specmd report --publish saves a W&B Report, which needs W&B online (a key: wandb "
                              "login); the run was logged offline")
        url = publish_report(sections, entity, project, name)
    return url


def publish_report(sections: list, entity: Optional[str], project: str, run_name: str, wr=None) -> str:
    """A W&B Report with a heading, the paper's claim and the computed verdict, the table and the figures of
    every section, each panel reading the report run ``run_name``."""
    if wr is None:
        try:
            import wandb_workspaces.reports.v2 as wr
        except ImportError:
            raise ConfigError("specmd report --publish needs wandb-workspaces: pip install 'specmd[reports]'") from None
    runset = wr.Runset(entity=entity or "", project=project, name="specmd report", query=run_name)
    blocks = [wr.TableOfContents()]
    for sec in sections:
        blocks.append(wr.H2(text=sec.spec.title or sec.spec.id))
        if sec.spec.paper:
            blocks.append(wr.P(text=f"Paper: {sec.spec.paper}"))
        if sec.verdicts:  # the computed verdict (verdicts.py), as index.html shows it
            from .verdicts import summary

            blocks.append(wr.P(text=f"Verdict: {summary(sec.verdicts)}"))
            blocks.append(wr.UnorderedList(items=[f"{v.mark} {v.status}: {v.check.claim} — {v.values}"
                                                  for v in sec.verdicts]))
        panels = [wr.WeavePanelSummaryTable(table_name=f"{sec.spec.id}/table")]
        if sec.figures:
            panels.append(wr.MediaBrowser(title=sec.spec.id,
                                          media_keys=[f"{sec.spec.id}/figure_{i}" for i in range(1, len(sec.figures) + 1)]))
        blocks.append(wr.PanelGrid(runsets=[runset], panels=panels))
    report = wr.Report(project=project, entity=entity or "", title="specmd report: " + ", ".join(s.spec.id for s in sections),
                       description="Tables and figures written by specmd report", blocks=blocks)
    report.save()
    return report.url
