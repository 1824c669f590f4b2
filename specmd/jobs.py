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
the signal when one stopped the job (SIGTERM and SIGINT are turned into exceptions by
:func:`signals_raise`; SIGKILL leaves no ``failed.json`` and the job counts as interrupted).
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


def write_failed(run_dir: Path, stage: str, exc: BaseException, config: Optional[dict] = None,
                 partial: Optional[dict] = None) -> None:
    """``failed.json``: ``stage`` (one of :data:`STAGES`), ``kind`` (``config``, ``data``, ``signal`` or
    ``error``), ``error``, ``signal`` when a signal stopped the job, the config and what was computed before the
    failure (``partial``: cache and timing so far). A ``results.json`` an earlier run left in the directory is
    moved to ``results.stale-<token>.json``: kept, but the directory no longer says done."""
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
    if (run_dir / "results.json").exists():
        os.replace(run_dir / "results.json", run_dir / f"results.stale-{secrets.token_hex(4)}.json")
    write_json_atomic(run_dir / "failed.json", body)


class Interrupted(BaseException):
    """A signal stopped the job (SIGTERM from a scheduler or ``kill``, SIGINT from Ctrl-C)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name}")


@contextlib.contextmanager
def signals_raise():
    """While a job runs, SIGTERM and SIGINT raise :class:`Interrupted` in the main thread, so the job writes
    its ``failed.json`` (with the stage it was in) before the process exits; in the CLI's process and in a
    launcher's worker (joblib, submitit, Ray) alike. Only default handlers are replaced (a launcher's own
    handlers, e.g. submitit's, are left alone), and they are restored afterwards. The first signal makes both
    ignored, so a second one cannot interrupt the writing of ``failed.json``."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = (signal.SIG_DFL, signal.default_int_handler)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame):
        for s in saved:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s, h in saved.items():
        if h in defaults:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


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


def _sweep_end_callback():
    from hydra.experimental.callback import Callback

    class SweepEnd(Callback):
        """After a multirun, in the launching process, whatever the launcher: reads the sweep directory
        (``specmd status``) and sets the exit code: 0 when every job is done, 2 when only config or data
        errors failed jobs (``failed.json``'s ``kind``), 1 otherwise (as a single run exits)."""

        def on_multirun_start(self, config, **kwargs) -> None:
            """The launcher's own settings, before it starts a job: a value it would fail on with a traceback
            (joblib's ``n_jobs=0``) is one line and exit code 2, like a job's config error."""
            import sys

            from omegaconf import OmegaConf

            launcher = OmegaConf.to_container(config.hydra.launcher, resolve=True) or {}
            target = str(launcher.get("_target_", "")).lower()
            errors = []
            if "joblib" in target and launcher.get("n_jobs") == 0:
                errors.append("hydra.launcher.n_jobs=0 runs no job: set a number of parallel jobs >= 1, or -1 for "
                              "one per core")
            for key in ("jobs_per_task", "cpus_per_task", "tasks_per_node", "nodes"):
                v = launcher.get(key)
                if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                    errors.append(f"hydra.launcher.{key}={v} must be >= 1")
            if errors:
                print("specmd: error: " + "; ".join(errors), file=sys.stderr)
                raise SystemExit(2)

        def on_multirun_end(self, config, **kwargs) -> None:
            import sys

            from .report.collect import load_sweep
            from .report.status import job_state

            sweep_dir = Path(str(config.hydra.sweep.dir))
            states = [(job_state(j), j) for j in load_sweep(sweep_dir).jobs]
            bad = [(s, j) for s, j in states if s != "done"]
            print(f"specmd: sweep {sweep_dir}: {len(states) - len(bad)} of {len(states)} jobs done"
                  + (f"; not done: " + ", ".join(f"{' '.join(j.overrides)} ({s})" for s, j in bad) if bad else ""),
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
