"""``specmd status SWEEP_DIR...``: which jobs of a sweep are done, failed, running or missing, and the
command that resumes it (a re-launch runs only the jobs that are not done, :mod:`specmd.jobs`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from .collect import Job, load_sweep


def job_state(job: Job) -> str:
    """``done``, ``failed``, ``running`` (its directory's lock is held) or ``missing`` (never started, or
    interrupted without a trace: SIGKILL, a lost node)."""
    if job.status == "ok":
        return "done"
    if job.status == "failed":
        return "failed"
    if job.dir is not None and (Path(job.dir) / ".lock").exists():
        from filelock import FileLock, Timeout

        try:
            with FileLock(str(Path(job.dir) / ".lock")).acquire(timeout=0):
                pass
        except Timeout:
            return "running"
    return "missing"


def resume_command(sweep_dir: Path) -> Optional[str]:
    """The command line that re-launches the sweep into its own directory: its overrides and its Hydra
    overrides (launcher, search path...), but the sweep directory."""
    from omegaconf import OmegaConf

    mr = sweep_dir / "multirun.yaml"
    if not mr.exists():
        return None
    ov = OmegaConf.load(mr).hydra.overrides
    task = list(ov.task)
    own = [o for o in (ov.get("hydra") or []) if not o.split("=", 1)[0] in ("hydra.mode", "hydra.sweep.dir")]
    return shlex.join(["python", "-m", "specmd", "-m", *task, *own, f"hydra.sweep.dir={sweep_dir}"])


def _sweep_dirs(path: Path) -> list:
    if (path / "multirun.yaml").exists() or (path / ".hydra" / "config.yaml").exists():
        return [path]
    found = sorted(m.parent for m in path.rglob("multirun.yaml"))
    if not found:
        raise ConfigError(f"{path}: no sweep (multirun.yaml) or run directory below it")
    return found


def main(argv: Optional[list] = None) -> int:
    """Prints each sweep's counts and its unfinished jobs; exit 0 when every job is done, 1 otherwise."""
    ap = argparse.ArgumentParser(prog="specmd status", description=__doc__)
    ap.add_argument("paths", nargs="+", help="sweep directories, run directories, or parents of them")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the done jobs too")
    args = ap.parse_args(argv)
    complete = True
    try:
        for p in map(Path, args.paths):
            if not p.exists():
                raise ConfigError(f"{p}: no such directory")
            for d in _sweep_dirs(p):
                sweep = load_sweep(d)
                states = [(job_state(j), j) for j in sweep.jobs]
                counts = {s: sum(st == s for st, _ in states) for s in ("done", "failed", "running", "missing")}
                print(f"{d}  ({sweep.experiment}): {len(states)} jobs: "
                      + ", ".join(f"{n} {s}" for s, n in counts.items()))
                for st, j in states:
                    if st != "done" or args.verbose:
                        why = f"  [{j.results.get('stage')}] {j.error}" if st == "failed" else ""
                        print(f"  {st:8s} {' '.join(j.overrides) or '(no overrides)'}  {j.dir or ''}{why}")
                if counts["done"] < len(states):
                    complete = False
                    cmd = resume_command(d)
                    if cmd:
                        print(f"  resume: {cmd}")
    except ConfigError as exc:
        print(f"specmd status: error: {exc}", file=sys.stderr)
        return 2
    return 0 if complete else 1
