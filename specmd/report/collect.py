"""Step 1 of a report: find the sweeps, the jobs each sweep was asked to run, and what each job left.

A sweep directory is what ``python -m specmd -m`` writes: ``multirun.yaml`` (the composed config with
``hydra.overrides.task`` and ``hydra.sweeper.params``) and one directory per job holding
``.hydra/overrides.yaml`` (the job's manifest) and ``results.json`` (finished) or ``failed.json``. The jobs a
sweep was *asked* for are recomputed from ``multirun.yaml`` with Hydra's own override parser and the basic
sweeper's expansion, so a job that never started is reported missing rather than silently absent. A plain
run directory (``results.json`` and ``.hydra/``) is a sweep of one job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError


@dataclass
class Job:
    """One job of a sweep. ``status``: ``ok`` (results.json), ``failed`` (failed.json), ``missing`` (asked
    for, no directory or no output: not run yet, still running, or killed)."""

    overrides: list  # ["eviction=lru", "hardware.capacity=0.05", ...] as the user typed them
    status: str
    dir: Optional[str] = None
    results: dict = field(default_factory=dict)  # results.json (or failed.json's partial results)
    error: Optional[str] = None
    config: dict = field(default_factory=dict)  # the job's resolved config (its sweep's, for a job that never ran)

    @property
    def axes(self) -> dict:
        """Override key (``+``/``++``/``~`` stripped) -> value string."""
        out = {}
        for o in self.overrides:
            key, _, value = o.partition("=")
            out[key.lstrip("+~")] = value
        return out


@dataclass
class Sweep:
    dir: str
    experiment: str  # the config's ``experiment`` (or the directory name)
    spec: dict  # the config's ``report`` section (may be empty)
    jobs: list
    time: float = 0.0  # multirun.yaml's mtime: which of several sweeps of one experiment is newest


def _normalise(overrides: list) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in overrides])
    return sorted(f"{o.input_line.split('=', 1)[0]}={o.get_value_element_as_str()}" for o in parsed)


def expected_jobs(multirun: dict) -> list:
    """The override lists of every job the sweep expands to (Hydra's basic sweeper: sweeper.params first,
    then the command line, cartesian product in that order)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra = multirun.get("hydra") or {}
    params = ((hydra.get("sweeper") or {}).get("params")) or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(((hydra.get("overrides") or {}).get("task")) or [])
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
    return [job for batch in batches for job in batch]


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _job_dirs(root: Path) -> dict:
    """Normalised overrides -> job directory, for every job directory under ``root``."""
    from omegaconf import OmegaConf

    out = {}
    for manifest in root.rglob(".hydra/overrides.yaml"):
        job_dir = manifest.parent.parent
        if job_dir == root:
            continue
        out[tuple(_normalise(list(OmegaConf.load(manifest))))] = job_dir
    return out


def _job(overrides: list, job_dir: Optional[Path], base: dict) -> Job:
    """``base``: the sweep's config without its overrides; a job that wrote nothing is described by it (its
    swept values come from its overrides, tables.axis_value)."""
    if job_dir is None:
        return Job(overrides, "missing", config=base)
    res = _read(job_dir / "results.json")
    if res is not None:
        return Job(overrides, "ok", str(job_dir), res, config=res.get("config") or base)
    failed = _read(job_dir / "failed.json")
    if failed is not None:
        return Job(overrides, "failed", str(job_dir), failed, failed.get("error"), failed.get("config") or base)
    log = job_dir / "__main__.log"
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return Job(overrides, "missing", str(job_dir), error=(tail[0][:300] if tail else None), config=base)


def load_sweep(path: Path) -> Sweep:
    """A sweep directory (``multirun.yaml``) or a single run directory (``results.json`` + ``.hydra``)."""
    from omegaconf import OmegaConf

    import yaml
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    try:
        return _load_sweep(path)
    except ConfigError:
        raise
    except (UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException, ValueError, KeyError, TypeError,
            AttributeError) as exc:  # not YAML, or not a sweep's
        raise ConfigError(f"{path}: its multirun.yaml or .hydra files cannot be read as a Hydra sweep "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def _load_sweep(path: Path) -> Sweep:
    from omegaconf import OmegaConf

    if (path / "multirun.yaml").exists():
        mr = OmegaConf.to_container(OmegaConf.load(path / "multirun.yaml"), resolve=False)
        dirs = _job_dirs(path)
        base = {k: v for k, v in mr.items() if k != "hydra"}
        jobs = [_job(ov, dirs.get(tuple(_normalise(ov))), base) for ov in expected_jobs(mr)]
        time = (path / "multirun.yaml").stat().st_mtime
    elif (path / ".hydra" / "config.yaml").exists():
        mr = OmegaConf.to_container(OmegaConf.load(path / ".hydra" / "config.yaml"), resolve=False)
        overrides = list(OmegaConf.load(path / ".hydra" / "overrides.yaml"))
        jobs = [_job(overrides, path, {k: v for k, v in mr.items() if k != "hydra"})]
        time = (path / ".hydra" / "config.yaml").stat().st_mtime
    else:
        raise ConfigError(f"{path}: not a specmd sweep (no multirun.yaml) or run directory (no .hydra/config.yaml)")
    return Sweep(str(path), str(mr.get("experiment") or path.name), dict(mr.get("report") or {}), jobs, time)


def find_sweeps(paths: list) -> tuple[list, list]:
    """Sweeps under ``paths``, and notes on what was left out. A path that is itself a sweep or run is read as
    is (several of one experiment are combined: the user named them). A parent directory is searched for
    sweeps, and of several sweeps of the same experiment found there only the newest is read (older
    re-runs are listed in the notes, never mixed in)."""
    sweeps, notes = [], []
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"{p}: no such directory")
        if (p / "multirun.yaml").exists() or (p / ".hydra" / "config.yaml").exists():
            sweeps.append(load_sweep(p))
            continue
        found = [load_sweep(m.parent) for m in sorted(p.rglob("multirun.yaml"))]
        if not found:
            raise ConfigError(f"{p}: no sweep (multirun.yaml) below it")
        newest = newest_per_experiment(found)
        notes += [f"{s.dir}: an older sweep of {s.experiment}, not read (name it to include it)"
                  for s in found if s not in newest]
        sweeps += newest
    return sweeps, notes


def newest_per_experiment(sweeps: list) -> list:
    """Of several sweeps of one experiment, the newest (re-runs are never mixed in as repeats)."""
    newest: dict = {}
    for s in sweeps:
        if s.experiment not in newest or s.time > newest[s.experiment].time:
            newest[s.experiment] = s
    return list(newest.values())


def sweep_for_also(sweeps: list, name: str, roots: list) -> Optional[Sweep]:
    """The newest sweep of experiment ``name`` among ``sweeps`` or below the parents of their directories
    (``report.also``: an experiment whose figure draws another one's runs)."""
    have = [s for s in sweeps if s.experiment == name]
    if have:
        return max(have, key=lambda s: s.time)
    cands, seen = [], set()
    # outputs/experiments/<experiment>/<time> (the experiments' layout) or <dir>/<experiment> (a chosen one)
    for root in {p for r in roots for p in (Path(r).parent.parent, Path(r).parent)}:
        base = root / name
        if base.is_dir() and base.resolve() not in seen:
            seen.add(base.resolve())
            cands += [load_sweep(m.parent) for m in base.rglob("multirun.yaml")]
    return max(cands, key=lambda s: s.time) if cands else None


def unfinished(sweeps: list) -> list:
    """(status, what: overrides, directory and error) of each job of ``sweeps`` that did not finish."""
    out = []
    for s in sweeps:
        for j in s.jobs:
            if j.status != "ok":
                what = " ".join(j.overrides) or "(no overrides)"
                why = f": {j.error}" if j.error else ""
                where = f" ({j.dir})" if j.dir else ""
                out.append((j.status, f"{what}{where}{why}"))
    return out
