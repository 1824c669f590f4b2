"""``specmd status SWEEP_DIR...``: which jobs of a sweep are done, failed, running, pending or missing, and the
command that resumes it (a re-launch runs only the jobs that are not done, :mod:`specmd.jobs`). While the
process that launched the sweep lives (it holds ``.sweep.lock``: :func:`specmd.liveness.hold_sweep`) the jobs it has
not started are *pending*, not missing, and no resume command is offered: it would run them twice.

What it cannot read is named, never a traceback: a job directory without a readable ``.hydra/overrides.yaml``
or with a ``results.json`` that is no JSON object (``specmd status: <dir>: skipped: ...``; its job counts as
not done), a done job's ``results.json`` holding NaN or Infinity (``specmd status: <file>: cache.hit_rate is
NaN``), a sweep below a named parent whose ``multirun.yaml`` cannot be read (skipped; the exit is then 1). A
directory named on the command line that is no sweep is an error (exit 2)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..liveness import sweep_live, sweep_runner
from ..sweeps import job_state, load_sweep, sweeps_below


def resume_command(sweep_dir: Path) -> Optional[str]:
    """The command line that re-launches the sweep into its own directory: its overrides and its Hydra
    overrides (launcher, search path...), but the sweep directory."""
    from omegaconf import OmegaConf

    mr = sweep_dir / "multirun.yaml"
    if not mr.exists():
        return None
    try:
        ov = OmegaConf.to_container(OmegaConf.load(mr), resolve=False)["hydra"]["overrides"]
        task = [str(o) for o in ov.get("task") or []]
        own = [str(o) for o in (ov.get("hydra") or [])
               if not str(o).split("=", 1)[0] in ("hydra.mode", "hydra.sweep.dir")]
    except Exception:  # noqa: BLE001 -- load_sweep read it; a multirun.yaml without hydra.overrides has no command
        return None
    return shlex.join(["python", "-m", "specmd", "-m", *task, *own, f"hydra.sweep.dir={sweep_dir}"])


def _sweep_dirs(path: Path) -> tuple[list, bool]:
    """The sweep directories ``path`` names, and whether it named one itself (else they were found below it)."""
    if (path / "multirun.yaml").exists() or (path / ".hydra" / "config.yaml").exists():
        return [path], True
    found = sweeps_below(path)
    if not found:
        raise ConfigError(f"{path}: no sweep (multirun.yaml) or run directory (.hydra/config.yaml) below it")
    return found, False


def main(argv: Optional[list] = None) -> int:
    """Prints each sweep's counts and its unfinished jobs; exit 0 when every job is done, 1 otherwise (bad input:
    a ConfigError, one line and exit 2 from specmd.ending)."""
    from ..errors import ArgumentParser

    ap = ArgumentParser(prog="specmd status", description=__doc__)
    ap.add_argument("paths", nargs="+", help="sweep directories, run directories, or parents of them")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the done jobs too")
    args = ap.parse_args(argv)
    complete = True
    for p in map(Path, args.paths):
        if not p.exists():
            raise ConfigError(f"{p}: no such directory")
        dirs, named = _sweep_dirs(p)
        for d in dirs:
            try:
                sweep = load_sweep(d)
            except ConfigError as exc:
                if named:
                    raise
                print(f"specmd status: skipped: {exc}", file=sys.stderr)
                complete = False
                continue
            for w in sweep.warnings:
                print(f"specmd status: {w}", file=sys.stderr)
            for j in sweep.jobs:
                for key, why in j.problems.items():
                    print(f"specmd status: {j.file}: {key} is {why}", file=sys.stderr)
            live = sweep_live(d)
            states = [(job_state(j, live), j) for j in sweep.jobs]
            counts = {s: sum(st == s for st, _ in states) for s in ("done", "failed", "running", "pending", "missing")}
            print(f"{d}  ({sweep.experiment}): {len(states)} jobs: "
                  + ", ".join(f"{n} {s}" for s, n in counts.items() if n or s != "pending")
                  + (f"; running: launched by {sweep_runner(d)}" if live else ""))
            for st, j in states:
                if st != "done" or args.verbose:
                    why = (f"  [{j.results.get('stage')}] {j.error}" if st == "failed"
                           else f"  ({j.error})" if st == "missing" and j.error else "")
                    print(f"  {st:8s} {' '.join(j.overrides) or '(no overrides)'}  {j.dir or ''}{why}")
            if counts["done"] < len(states):
                complete = False
                cmd = None if live else resume_command(d)  # (a live launcher runs the pending jobs itself)
                if cmd:
                    print(f"  resume: {cmd}")
    return 0 if complete else 1
