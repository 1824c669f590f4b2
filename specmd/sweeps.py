"""A sweep on disk: find the sweeps, the jobs each sweep was asked to run, what each job left, and the state of
each job. ``specmd report`` reads them (its step 1), ``specmd status`` and a sweep's exit code
(:func:`specmd.cli.launch.sweep_exit`) too, all from here.

A sweep directory is what ``python -m specmd -m`` writes: ``multirun.yaml`` (the composed config with
``hydra.overrides.task`` and ``hydra.sweeper.params``) and one directory per job holding
``.hydra/overrides.yaml`` (the job's manifest) and ``results.json`` (finished) or ``failed.json``. The jobs a
sweep was *asked* for are recomputed from ``multirun.yaml`` with Hydra's own override parser and the basic
sweeper's expansion, so a job that never started is reported missing rather than silently absent. A plain
run directory (``results.json`` and ``.hydra/``) is a sweep of one job.

What cannot be read is never a traceback: a job directory whose ``.hydra/overrides.yaml`` is absent, not
YAML or not a list of overrides is skipped (a warning names it and why: the job it holds then counts as
missing), a ``results.json`` that is not a JSON object counts as not finished (named too), a value in a
``results.json`` that is no finite number (Python's json reads ``NaN`` and ``Infinity``) is recorded on its
job (``Job.problems``) and named by ``specmd report`` and ``specmd status``. A sweep directory whose
``multirun.yaml`` cannot be read is a :class:`ConfigError` naming it when it was named, and skipped with a
note when it was found below a parent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import ConfigError, DamagedFile
from .readers import read_failed, read_results
from .results import rescued


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
    own_config: bool = True  # False: ``config`` is its sweep's (the job wrote none), the keys its overrides set unknown
    problems: dict = field(default_factory=dict)  # results path -> what it holds that is no finite number ("NaN")

    @property
    def file(self) -> str:
        """The file its numbers come from (``<dir>/results.json``), for messages."""
        return f"{self.dir}/results.json" if self.dir and not self.dir.startswith("wandb:") else str(self.dir)

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
    warnings: list = field(default_factory=list)  # what could not be read (a directory skipped, a file garbled)


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _read(path: Path, reader) -> tuple[Optional[dict], Optional[str]]:
    """(the checked record in ``path``, None), (None, None) when there is no such file, or (None, why it cannot
    be used: :class:`~specmd.errors.DamagedFile`'s reason). ``reader``: :mod:`specmd.readers`' for its kind."""
    try:
        return reader(path), None
    except FileNotFoundError:
        return None, None
    except DamagedFile as exc:
        return None, exc.why


def non_finite(results: dict) -> dict:
    """Dotted path -> ``NaN`` / ``Infinity`` / ``-Infinity`` of every non-finite number in a results.json
    (its ``config`` and ``provenance`` left out): specmd writes such a value as null, so one is a damaged or
    hand-edited file."""
    from .results import non_finite as found

    body = {k: v for k, v in results.items() if k not in ("config", "provenance")}
    return {at: "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity" for at, v in found(body).items()}


def read_overrides(path: Path) -> tuple[Optional[list], Optional[str]]:
    """(a job's overrides from its ``.hydra/overrides.yaml``, None) or (None, why they cannot be read)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, "no .hydra/overrides.yaml"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        return None, f"its .hydra/overrides.yaml is not readable as YAML ({_first_line(exc)})"
    if data is None:
        data = []
    if not isinstance(data, list) or not all(isinstance(o, str) for o in data):
        return None, (f"its .hydra/overrides.yaml is not a list of overrides (key=value strings), but "
                      f"{str(data)[:80]!r}")
    try:
        _normalise(data)
    except Exception as exc:  # noqa: BLE001 -- Hydra's parser raises its own (HydraException) and ValueErrors
        return None, f"its .hydra/overrides.yaml holds no Hydra override list ({_first_line(exc)})"
    return data, None


def _job_dirs(root: Path, warnings: list) -> dict:
    """Normalised overrides -> job directory, for every job directory under ``root``; a directory whose
    manifest cannot be read is skipped with a warning (its job then counts as missing)."""
    out = {}
    for manifest in sorted(root.rglob(".hydra/overrides.yaml")):
        job_dir = manifest.parent.parent
        if job_dir == root:
            continue
        overrides, why = read_overrides(manifest)
        if overrides is None:
            warnings.append(f"{job_dir}: skipped: {why}")
            continue
        out[tuple(_normalise(overrides))] = job_dir
    seen = set(out.values())
    for name in ("results.json", "failed.json"):
        for f in sorted(root.rglob(name)):
            d = f.parent
            if d != root and d not in seen and not (d / ".hydra" / "overrides.yaml").exists():
                seen.add(d)
                warnings.append(f"{d}: skipped: it holds {name} but no .hydra/overrides.yaml (which job of the "
                                "sweep it ran cannot be told)")
    return out


def _job(overrides: list, job_dir: Optional[Path], base: dict, warnings: list) -> Job:
    """``base``: the sweep's config without its overrides; a job that wrote nothing is described by it (its
    swept values come from its overrides, specmd.commands.report.tables.axis_value)."""
    if job_dir is None:
        return Job(overrides, "missing", config=base, own_config=False)
    res, why = _read(job_dir / "results.json", read_results)
    if why:
        warnings.append(f"{job_dir / 'results.json'}: {why}: the job counts as not finished")
    if res is not None:
        cfg = res.get("config")
        own = isinstance(cfg, dict) and bool(cfg)
        job = Job(overrides, "ok", str(job_dir), res, config=cfg if own else base, own_config=own)
        job.problems.update(non_finite(res))
        return job
    failed, why_failed = _read(job_dir / "failed.json", read_failed)
    if why_failed:
        warnings.append(f"{job_dir / 'failed.json'}: {why_failed}")
    kept = None
    if failed is None and not why and not why_failed:  # the directory could not take it: kept elsewhere?
        kept = rescued(job_dir, "failed.json")
        failed, why_failed = _read(kept, read_failed) if kept else (None, None)
    if failed is not None:
        cfg = failed.get("config")
        own = isinstance(cfg, dict) and bool(cfg)
        error = failed.get("error")
        if kept:
            error = f"{error} (its record is kept in {kept}: the run directory could not take it)"
        return Job(overrides, "failed", str(job_dir), failed, error, cfg if own else base, own_config=own)
    tail = []
    try:
        log = job_dir / "__main__.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    except OSError:
        pass
    error = f"results.json {why}" if why else (tail[0][:300] if tail else None)
    return Job(overrides, "missing", str(job_dir), error=error, config=base, own_config=False)


def load_sweep(path: Path) -> Sweep:
    """A sweep directory (``multirun.yaml``) or a single run directory (``results.json`` + ``.hydra``)."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    try:
        return _load_sweep(path)
    except ConfigError:
        raise
    except (OSError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException, HydraException, ValueError,
            KeyError, TypeError, AttributeError) as exc:  # unreadable, not YAML, or not a sweep's
        raise ConfigError(f"{path}: its multirun.yaml or .hydra files cannot be read as a Hydra sweep "
                          f"({_first_line(exc)})") from None


def _load_sweep(path: Path) -> Sweep:
    from omegaconf import OmegaConf

    warnings: list = []
    if (path / "multirun.yaml").exists():
        mr = OmegaConf.to_container(OmegaConf.load(path / "multirun.yaml"), resolve=False)
        if not isinstance(mr, dict):
            raise ConfigError(f"{path / 'multirun.yaml'}: not a mapping (a Hydra sweep's composed config)")
        dirs = _job_dirs(path, warnings)
        base = {k: v for k, v in mr.items() if k != "hydra"}
        jobs = [_job(ov, dirs.get(tuple(_normalise(ov))), base, warnings) for ov in expected_jobs(mr)]
        time = (path / "multirun.yaml").stat().st_mtime
    elif (path / ".hydra" / "config.yaml").exists():
        mr = OmegaConf.to_container(OmegaConf.load(path / ".hydra" / "config.yaml"), resolve=False)
        if not isinstance(mr, dict):
            raise ConfigError(f"{path / '.hydra' / 'config.yaml'}: not a mapping (a run's composed config)")
        overrides, why = read_overrides(path / ".hydra" / "overrides.yaml")
        if overrides is None:  # a run's config says what it ran: its axes come from there
            warnings.append(f"{path}: {why}: read as a run without overrides (its axes from its config)")
            overrides = []
        jobs = [_job(overrides, path, {k: v for k, v in mr.items() if k != "hydra"}, warnings)]
        time = (path / ".hydra" / "config.yaml").stat().st_mtime
    else:
        raise ConfigError(f"{path}: not a specmd sweep (no multirun.yaml) or run directory (no .hydra/config.yaml)")
    report = mr.get("report") or {}
    if not isinstance(report, dict):
        raise ConfigError(f"{path}: its config's report section is not a mapping, but {str(report)[:80]!r}")
    return Sweep(str(path), str(mr.get("experiment") or path.name), dict(report), jobs, time, warnings)


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
        found = _load_below(sweeps_below(p), notes)
        if not found:
            raise ConfigError(f"{p}: no sweep (multirun.yaml) or run directory (.hydra/config.yaml) below it"
                              + (" that can be read" if notes else ""))
        multi = [s for s in found if (Path(s.dir) / "multirun.yaml").exists()]
        newest = newest_per_experiment(multi)
        notes += [f"{s.dir}: an older sweep of {s.experiment}, not read (name it to include it)"
                  for s in multi if s not in newest]
        swept = {s.experiment for s in multi}  # a single run (a debugging run of an experiment) never hides its
        for s in found:  # sweep: read only where no sweep of its experiment was found
            if s not in multi:
                if s.experiment in swept:
                    notes.append(f"{s.dir}: a single run of {s.experiment}, which a sweep below {p} covers: not "
                                 "read (name it to include it)")
                else:
                    newest.append(s)
        sweeps += newest
    return sweeps, notes


def sweeps_below(parent: Path) -> list:
    """The sweep directories (``multirun.yaml``) below ``parent``, and the single runs' directories
    (``.hydra/config.yaml``) that lie in none of them: ``specmd report outputs`` and ``specmd status outputs``
    read the runs of ``outputs/<date>/<time>`` as well as the sweeps of ``outputs/multirun``."""
    sweeps = sorted(m.parent for m in parent.rglob("multirun.yaml"))
    runs = sorted(c.parent.parent for c in parent.rglob(".hydra/config.yaml"))
    return sweeps + [r for r in runs if not any(s == r or s in r.parents for s in sweeps)]


def _load_below(dirs: list, notes: list) -> list:
    """The sweeps in ``dirs`` (found below a directory the user named); one that cannot be read is left out,
    with a note saying why."""
    out = []
    for d in dirs:
        try:
            out.append(load_sweep(d))
        except ConfigError as exc:
            notes.append(f"skipped: {exc}")
    return out


def newest_per_experiment(sweeps: list) -> list:
    """Of several sweeps of one experiment, the newest (re-runs are never mixed in as repeats)."""
    newest: dict = {}
    for s in sweeps:
        if s.experiment not in newest or s.time > newest[s.experiment].time:
            newest[s.experiment] = s
    return list(newest.values())


def sweep_for_also(sweeps: list, name: str, roots: list, notes: Optional[list] = None) -> Optional[Sweep]:
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
            cands += _load_below([m.parent for m in sorted(base.rglob("multirun.yaml"))],
                                 notes if notes is not None else [])
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


def job_state(job: Job, live: bool = False) -> str:
    """``done``, ``failed``, ``running`` (its directory's lock is held), ``pending`` (not started, or starting,
    in a sweep whose launcher is ``live``: :func:`specmd.liveness.sweep_live`) or ``missing`` (never started, or
    interrupted without a trace: SIGKILL, a lost node)."""
    state = _state(job)
    return "pending" if live and state == "missing" else state


def _state(job: Job) -> str:
    if job.status == "ok" and job.results.get("config_hash"):
        return "done"
    if job.status == "ok":  # what a re-launch would not count as done either (specmd.jobs.finished): say so
        job.error = job.error or "its results.json has no config_hash (damaged, or not written by a specmd run): a " \
                                 "re-launch runs it again"
        return "missing"
    if job.status == "failed":
        return "failed"
    if job.dir is not None and (Path(job.dir) / ".lock").exists():
        from filelock import FileLock, Timeout

        try:
            with FileLock(str(Path(job.dir) / ".lock")).acquire(timeout=0):
                pass
        except Timeout:
            return "running"
        except OSError:  # a lock this user cannot open (another user's, a read-only copy): no process of ours
            return "missing"
    return "missing"
