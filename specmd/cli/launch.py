"""Hydra's side of specmd: what its configs and launchers need that Hydra does not know.

* the launchers: each job's torch threads (:func:`torch_threads`) and the launcher settings a launcher would
  fail on with a traceback (:func:`launcher_errors`), one line and exit code 2 instead;
* the :class:`SweepEnd` callback (``hydra.callbacks`` in ``conf/config.yaml``): a single run's directory claimed
  before Hydra writes into it, a sweep's directory held while it runs, and the sweep's exit code at its end.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback

from ..jobs import OPENED, claim_run_dir, usable_cores
from ..liveness import hold_sweep, release_sweep


def torch_threads(requested: Optional[int], launcher: dict) -> Optional[int]:
    """Intra-op threads for one job: ``threads`` when set; else the cores this process may use divided by
    the jobs its launcher runs beside it on one machine (joblib's ``n_jobs``), or the task's CPUs (submitit's
    ``cpus_per_task``, Ray's ``num_cpus``); None (torch's default, every core) for a job running alone. Two
    jobs each spinning every core of a small machine ran 10-19x slower than with one thread each."""
    if requested is not None:
        return requested
    target = str(launcher.get("_target_", "")).lower()
    cores = usable_cores()
    if "joblib" in target:
        n = launcher.get("n_jobs") or -1
        n = cores if n < 0 else n
        return max(1, cores // max(1, n))
    if "submitit" in target:  # SLURM gives a task one CPU unless cpus_per_task asks for more; submitit's
        return launcher.get("cpus_per_task") or 1  # local executor runs every task at once
    if "ray" in target:
        cpus = ((launcher.get("ray") or {}).get("remote") or {}).get("num_cpus")
        return int(cpus) if cpus else 1  # Ray's default task reserves one CPU
    return None


SWEEP_EXIT = {"code": 0}  # set by SweepEnd in the process that launched the sweep

@contextlib.contextmanager
def _refusing():
    """A check in a Hydra callback: its :class:`~specmd.errors.ConfigError` is one line and exit 2, a file it
    cannot write (a full disk) one line naming it and the exit code of specmd.ending's table (Hydra turns an
    exception raised in a callback into a warning and goes on, so the check exits itself)."""
    from ..errors import ConfigError, file_error, say

    try:
        yield
    except ConfigError as exc:
        say("specmd", str(exc))
        raise SystemExit(2) from None
    except OSError as exc:
        known = file_error(exc)
        if known is None:
            raise
        say("specmd", known[1])
        raise SystemExit(known[0]) from None


def launcher_errors(launcher: dict) -> list:
    """What the launcher's own settings (``hydra.launcher``, resolved) would fail on with a traceback, or run
    no job with, each as one message: joblib's ``n_jobs=0``, submitit's counts below 1 and memory at or below
    zero, SLURM without ``srun``."""
    import shutil

    target = str(launcher.get("_target_", "")).lower()
    errors = []
    if "joblib" in target and launcher.get("n_jobs") == 0:
        errors.append("hydra.launcher.n_jobs=0 runs no job: set a number of parallel jobs >= 1, or -1 for "
                      "one per core")
    for key in ("jobs_per_task", "cpus_per_task", "tasks_per_node", "nodes", "timeout_min",
                "array_parallelism"):  # submitit's: a zero ran nothing, or failed "No error stream"
        v = launcher.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            errors.append(f"hydra.launcher.{key}={v} must be >= 1")
    for key in ("mem_gb", "gpus_per_node"):
        v = launcher.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (v < 0 or key == "mem_gb" and v == 0):
            errors.append(f"hydra.launcher.{key}={v} must be " + (">= 0" if key == "gpus_per_node" else
                                                                   "> 0 (GB per task), or null"))
    if "slurm" in target and shutil.which("srun") is None:  # submitit's own check is a traceback per job
        errors.append("hydra/launcher: SLURM's srun is not on this machine's PATH (submitit submits with "
                      "sbatch and runs with srun): launch from a SLURM login node, or use "
                      "hydra/launcher=specmd_joblib (this machine's cores) or specmd_submitit_local")
    return errors


class SweepEnd(Callback):
    """Hydra's callback (``hydra.callbacks`` in ``conf/config.yaml``): a single run's directory claimed before
    Hydra writes there; a job's directory remembered while it runs (however it ends, it says so); a sweep's
    launcher settings checked and its directory held while it runs; and after a multirun, in the launching
    process, whatever the launcher, the sweep directory read (``specmd status``) for the exit code: 0 when every
    job is done, 2 when only config or data errors failed jobs (``failed.json``'s ``kind``), 1 otherwise (as a
    single run exits)."""

    def on_run_start(self, config, **kwargs) -> None:
        """A single run's directory is claimed for it (:func:`~specmd.jobs.claim_run_dir`) before Hydra writes
        there."""
        with _refusing():
            run_dir = Path(str(config.hydra.run.dir)).absolute()
            claim_run_dir(run_dir, str(config.hydra.output_subdir or ".specmd-run"))
        OPENED["dir"] = run_dir  # from now on, however the job ends, the directory says so (failed.json)

    def on_job_start(self, config, **kwargs) -> None:
        """A sweep's job directory, once Hydra has made it and saved its config there (a single run's: as soon
        as it exists, on_run_start), in the process that runs the job (a launcher's worker too)."""
        OPENED["dir"] = Path(str(config.hydra.runtime.output_dir))

    def on_job_end(self, config, job_return=None, **kwargs) -> None:
        OPENED.pop("dir", None)  # recorded by the job itself (results.json or failed.json)

    def on_multirun_start(self, config, **kwargs) -> None:
        """The launcher's own settings, before it starts a job: a value it would fail on with a traceback
        (joblib's ``n_jobs=0``) is one line and exit code 2, like a job's config error; then the sweep's
        directory is held (status tells its pending jobs from missing ones; a second launch is refused)."""
        from omegaconf import OmegaConf

        from ..errors import ConfigError
        from ..results import writable_dir

        errors = launcher_errors(OmegaConf.to_container(config.hydra.launcher, resolve=True) or {})
        with _refusing():
            if errors:
                raise ConfigError("; ".join(errors))
            sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
            writable_dir(sweep_dir, f"hydra.sweep.dir={sweep_dir}")  # (reused to resume: writable is enough)
            hold_sweep(sweep_dir)
        OPENED["sweep"] = sweep_dir

    def on_multirun_end(self, config, **kwargs) -> None:
        release_sweep()  # (the sweep has ended: a status probe from now on finds no launcher)
        SWEEP_EXIT["code"] = sweep_exit(Path(str(config.hydra.sweep.dir)))


def sweep_exit(sweep_dir: Path) -> int:
    """The exit code of the sweep in ``sweep_dir``, its jobs read as ``specmd status`` reads them (0 all done, 2
    only input errors failed, 1 otherwise); what is not done is said on stderr."""
    import sys

    from ..sweeps import job_state, load_sweep

    states = [(job_state(j), j) for j in load_sweep(sweep_dir).jobs]
    bad = [(s, j) for s, j in states if s != "done"]
    print(f"specmd: sweep {sweep_dir}: {len(states) - len(bad)} of {len(states)} jobs done"
          + ("; not done: " + ", ".join(f"{' '.join(j.overrides)} ({s})" for s, j in bad) if bad else ""),
          file=sys.stderr)
    if not bad:
        return 0
    print("specmd: see `specmd status " + str(sweep_dir) + "`; re-launching the same command with "
          f"hydra.sweep.dir={sweep_dir} runs only the jobs not done", file=sys.stderr)
    return 2 if all(s == "failed" and j.results.get("kind") in ("config", "data") for s, j in bad) else 1

