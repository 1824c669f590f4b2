"""A job's identity and lifecycle on disk: where it writes, whether it is already done, how it failed.

Job directories. A single run writes to ``outputs/<date>/<time>-<host>-<pid>``: two runs started in the
same second, on one machine or on several sharing a filesystem, never share a directory. A job of a sweep
writes to ``<sweep dir>/<overrides>-<hash>`` (:func:`job_dirname`, the ``specmd_job`` resolver): the same
job of a re-launched sweep lands in the same directory whatever its number or launcher, and two different
jobs never do.

Resume. ``results.json`` records ``config_hash``, a hash of the resolved config (:func:`config_hash`). A
sweep job whose directory already holds a ``results.json`` with the same hash is not run again: it is
reported done. A ``results.json`` of another config (the defaults changed between launches) is kept as
``results.<its hash>.json`` and the job runs. Failed and interrupted jobs (``failed.json`` or nothing) run
again. The hash covers the config, not specmd's code (a code change is a new sweep, in a new directory). While a job runs it holds ``<job dir>/.lock`` (a ``filelock``); a second launch that finds the lock
held skips the job as running elsewhere instead of writing into the same directory.

Failures. Every failure writes ``failed.json`` (:func:`write_failed`): the stage that failed (``config``,
``load``, ``stack`` -- which quantizes the experts --, ``evaluate``, ``replay``, ``write``), the error, and
the signal when one stopped the job (every signal of :data:`specmd.signals.ENDING` is turned into an exception
by :func:`signals_raise`; a job that ended before it could say so, in the instant between Hydra making its
directory and the job starting, gets one from :func:`record_unrecorded`; SIGKILL leaves no ``failed.json``
and the job counts as interrupted).
``results.json`` is written only by a job that succeeded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
from pathlib import Path
from typing import Optional

from .liveness import hold_sweep, release_sweep, sweep_live, sweep_runner  # noqa: F401 (a sweep's)
from .signals import SIGNALS, Interrupted, check_interrupt, signals_held, signals_raise  # noqa: F401 (the job's)

STAGES = ("config", "load", "stack", "evaluate", "replay", "write")
# keys that do not change a job's numbers, left out of its config hash (data: where the mirror lies)
UNHASHED = ("logger", "threads", "data")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9=,._+-]+")


def unique_suffix() -> str:
    """``<host>-<pid>``: no two processes running at the same time share it, on one machine or several."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def job_dirname(override_dirname: str) -> str:
    """A sweep job's directory name: its overrides, readable and capped at 80 characters, plus 8 hex digits
    of their hash (so two jobs that differ only past the cap, or only in characters replaced here, still get
    their own directory)."""
    digest = hashlib.sha256(override_dirname.encode()).hexdigest()[:8]
    readable = _NAME_CHARS.sub("_", override_dirname)[:80] or "job"
    return f"{readable}-{digest}"


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    # use_cache: one value per config, copied with Hydra's resolver cache into each job's config
    OmegaConf.register_new_resolver("specmd_unique", unique_suffix, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("specmd_job", job_dirname, replace=True)


def config_hash(resolved: dict) -> str:
    """sha256 (16 hex digits) of the resolved config without :data:`UNHASHED` keys: equal hashes, equal job."""
    body = {k: v for k, v in resolved.items() if k not in UNHASHED}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished(run_dir: Path, digest: str) -> Optional[dict]:
    """The job's ``results.json`` if it finished with this config; otherwise None, after moving a
    ``results.json`` of another config aside (kept, never overwritten) and a stale ``failed.json`` away."""
    path = run_dir / "results.json"
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        results = None
    except ValueError:  # not written by write_json_atomic: keep it for inspection, run again
        os.replace(path, run_dir / "results.unreadable.json")
        results = None
    if results is not None:
        if results.get("config_hash") == digest:
            return results
        os.replace(path, run_dir / f"results.{results.get('config_hash') or 'old'}.json")
    (run_dir / "failed.json").unlink(missing_ok=True)
    return None


def job_lock(run_dir: Path):
    """The lock a job holds while it runs (``FileLock``; acquire with ``timeout=0`` to skip a held one)."""
    from filelock import FileLock

    run_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(run_dir / ".lock"))


def rescue(run_dir: Path, name: str, body: dict) -> str:
    """Keep ``body`` (a run's results or failure record) that ``run_dir`` could not take -- a full disk, a
    directory made read-only mid-run -- in ``<tmp>/specmd-rescue/<run dir's name>-<pid>-<token>/<name>``
    (:func:`specmd.results.rescue_dir`); when even that fails, print it on stderr. Returns where it went, for the
    message that names it."""
    import sys

    from .results import rescue_dir, write_json_atomic

    path = rescue_dir(run_dir) / name
    try:
        write_json_atomic(path, {"run_dir": str(run_dir), **body})
        return str(path)
    except OSError:
        sys.stderr.write(f"specmd: {run_dir}/{name} could not be written anywhere; here it is:\n"
                         f"{json.dumps(body, default=str)}\n")
        return "stderr (above)"


def write_failed(run_dir: Path, stage: str, exc: BaseException, config: Optional[dict] = None,
                 partial: Optional[dict] = None) -> str:
    """``failed.json``: ``stage`` (one of :data:`STAGES`), ``kind`` (``config``, ``data``, ``signal`` or
    ``error``), ``error``, ``signal`` when a signal stopped the job, the config and what was computed before the
    failure (``partial``: cache and timing so far). A ``results.json`` an earlier run left in the directory is
    moved to ``results.stale-<token>.json``: kept, but the directory no longer says done. Returns where the
    record went (:func:`rescue` when the directory cannot take it)."""
    import secrets

    from .errors import ConfigError, DataError
    from .results import write_json_atomic

    run_dir = Path(run_dir)
    body = dict(partial or {})
    if config is not None:
        body.setdefault("config", config)
    kind = ("config" if isinstance(exc, ConfigError) else "data" if isinstance(exc, DataError)
            else "signal" if isinstance(exc, Interrupted) else "error")
    body.update(stage=stage, kind=kind, error=f"{type(exc).__name__}: {exc}")
    if kind == "error":  # not the user's input: where it went wrong, for a bug report (the CLI prints one line)
        import traceback

        body["traceback"] = "".join(traceback.format_exception(exc))
    if isinstance(exc, Interrupted):
        body["signal"] = exc.signal_name
    try:
        if (run_dir / "results.json").exists():
            os.replace(run_dir / "results.json", run_dir / f"results.stale-{secrets.token_hex(4)}.json")
        write_json_atomic(run_dir / "failed.json", body)
    except OSError as write_error:  # what was computed is not lost with the directory: kept, and named
        body["not_written"] = f"{run_dir / 'failed.json'}: {write_error}"
        return rescue(run_dir, "failed.json", body)
    return str(run_dir / "failed.json")


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (which SLURM, ``taskset`` or a container
    narrows), else every core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
OPENED: dict = {}  # "dir": the run directory Hydra made for the job this process is starting, "sweep": the sweep's
# directory (SweepEnd sets them)


def record_unrecorded(exc: BaseException) -> None:
    """A job's directory exists but the job ended before :func:`specmd.app.execute` could record how (a Ctrl-C
    while Hydra saved its config or while the run imported torch, a full disk under ``.hydra``): ``failed.json``
    with stage ``config`` there, so the directory never reads as a job that is still running or vanished.
    Nothing when the job recorded its own ending (``failed.json`` or ``results.json``) or exited by itself."""
    run_dir = OPENED.pop("dir", None)
    if run_dir is None or getattr(exc, "specmd_failed", None) or not isinstance(
            exc, (Exception, Interrupted, KeyboardInterrupt)):  # (SystemExit: the job exited by itself)
        return  # (specmd_failed: the job recorded it, perhaps elsewhere than its directory)
    if isinstance(exc, KeyboardInterrupt):  # a handler not specmd's raised it: a Ctrl-C all the same
        exc = Interrupted(signal.SIGINT)
    with signals_held():
        if not any((run_dir / n).exists() for n in ("failed.json", "results.json")):
            exc.specmd_failed = write_failed(run_dir, "config", exc)


def claim_run_dir(run_dir: Path, marker: str) -> None:
    """A single run's directory, claimed before Hydra writes anything into it: created (an error naming the
    path when it cannot be: under a file, read-only, a name too long), and marked as this run's by creating
    ``marker`` (Hydra's ``.hydra``) exclusively. A directory that already holds a run -- its marker, a
    ``results.json`` or a ``failed.json`` -- is refused: two runs given one ``hydra.run.dir`` used to both
    succeed, leaving one run's results beside the other's config. (A sweep's jobs resume in their directories
    instead: :func:`finished`.)"""
    from .errors import ConfigError
    from .results import writable_dir

    where = f"hydra.run.dir={run_dir}"
    writable_dir(run_dir, where).mkdir(parents=True, exist_ok=True)
    held = [n for n in (marker, "results.json", "failed.json") if (run_dir / n).exists()]
    try:
        if held:
            raise FileExistsError
        os.mkdir(run_dir / marker)  # exclusive: of two runs started together, one gets the directory
    except FileExistsError:
        raise ConfigError(f"{where} already holds a run ({', '.join(held) or marker}): a run directory holds one "
                          "run; choose another hydra.run.dir (or leave it out: each run gets its own), or remove "
                          "that directory") from None


@contextlib.contextmanager
def _refusing():
    """A check in a Hydra callback: its :class:`~specmd.errors.ConfigError` is one line and exit 2, a file it
    cannot write (a full disk) one line naming it and the exit code of specmd.cli.outcome's table (Hydra turns an
    exception raised in a callback into a warning and goes on, so the check exits itself)."""
    from .errors import ConfigError, file_error, say

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


def _sweep_end_callback():
    from hydra.experimental.callback import Callback

    from .errors import ConfigError

    class SweepEnd(Callback):
        """After a multirun, in the launching process, whatever the launcher: reads the sweep directory
        (``specmd status``) and sets the exit code: 0 when every job is done, 2 when only config or data
        errors failed jobs (``failed.json``'s ``kind``), 1 otherwise (as a single run exits)."""

        def on_run_start(self, config, **kwargs) -> None:
            """A single run's directory is claimed for it (:func:`claim_run_dir`) before Hydra writes there."""
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
            (joblib's ``n_jobs=0``) is one line and exit code 2, like a job's config error."""
            import shutil

            from omegaconf import OmegaConf

            launcher = OmegaConf.to_container(config.hydra.launcher, resolve=True) or {}
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
            with _refusing():
                if errors:
                    raise ConfigError("; ".join(errors))
                from .results import writable_dir  # a sweep directory is reused (resume): writable is enough

                sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
                writable_dir(sweep_dir, f"hydra.sweep.dir={sweep_dir}")
                hold_sweep(sweep_dir)  # status tells its pending jobs from missing ones; a second launch is refused
            OPENED["sweep"] = sweep_dir

        def on_multirun_end(self, config, **kwargs) -> None:
            import sys

            from .report.collect import load_sweep
            from .report.status import job_state

            release_sweep()  # (the sweep has ended: a status probe from now on finds no launcher)
            sweep_dir = Path(str(config.hydra.sweep.dir))
            states = [(job_state(j), j) for j in load_sweep(sweep_dir).jobs]
            bad = [(s, j) for s, j in states if s != "done"]
            print(f"specmd: sweep {sweep_dir}: {len(states) - len(bad)} of {len(states)} jobs done"
                  + ("; not done: " + ", ".join(f"{' '.join(j.overrides)} ({s})" for s, j in bad) if bad else ""),
                  file=sys.stderr)
            if bad:
                only_input = all(s == "failed" and j.results.get("kind") in ("config", "data") for s, j in bad)
                SWEEP_EXIT["code"] = 2 if only_input else 1
                print("specmd: see `specmd status " + str(sweep_dir) + "`; re-launching the same command with "
                      f"hydra.sweep.dir={sweep_dir} runs only the jobs not done", file=sys.stderr)

    return SweepEnd


def __getattr__(name):  # hydra.callbacks' _target_ specmd.jobs.SweepEnd, defined lazily (imports Hydra)
    if name == "SweepEnd":
        return _sweep_end_callback()
    raise AttributeError(name)
