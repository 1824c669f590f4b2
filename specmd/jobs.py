"""A job's identity and lifecycle on disk: where it writes, whether it is already done, how it failed.

Job directories. A single run writes to ``outputs/<date>/<time>-<host>-<pid>``: two runs started in the
same second, on one machine or on several sharing a filesystem, never share a directory. A job of a sweep
writes to ``<sweep dir>/<overrides>-<hash>`` (:func:`specmd.shipped.job_dirname`, the ``specmd_job`` resolver): the same
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
by :func:`specmd.signals.signals_raise`; a job that ended before it could say so, in the instant between Hydra making its
directory and the job starting, gets one from :func:`record_unrecorded`; SIGKILL leaves no ``failed.json``
and the job counts as interrupted).
``results.json`` is written only by a job that succeeded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Optional

from .errors import DamagedFile
from .machine import cgroup_cores, usable_cores  # noqa: F401 (the machine's facts, where runs record them)
from .readers import STAGES  # noqa: F401 (the stages a failed.json names; its reader checks them)
from .signals import Interrupted, signals_held

# keys that do not change a job's numbers, left out of its config hash (data: where the mirror lies)
UNHASHED = ("logger", "threads", "data")



def config_hash(resolved: dict) -> str:
    """sha256 (16 hex digits) of the resolved config without :data:`UNHASHED` keys: equal hashes, equal job."""
    body = {k: v for k, v in resolved.items() if k not in UNHASHED}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished(run_dir: Path, digest: str) -> Optional[dict]:
    """The job's ``results.json`` if it finished with this config; otherwise None, after moving a
    ``results.json`` of another config aside (kept, never overwritten) and a stale ``failed.json`` away."""
    from .readers import read_results

    path = run_dir / "results.json"
    try:
        results = read_results(path)
    except FileNotFoundError:
        results = None
    except DamagedFile as exc:  # not what write_json_atomic wrote: keep it for inspection, run again
        os.replace(path, run_dir / "results.unreadable.json")
        logging.getLogger("specmd").warning("%s; kept as results.unreadable.json, the job runs again", exc)
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


