"""Who is running what, for ``specmd status`` and a second launch: the process that launches a sweep holds
``<sweep dir>/.sweep.lock`` (a ``filelock``: the OS releases a dead process's lock, so a killed launcher never
leaves a sweep "running") and records itself in ``.sweep.json``; each job holds its directory's ``.lock``
while it runs (:func:`specmd.jobs.job_lock`). A module of its own, below :mod:`specmd.jobs` and
:mod:`specmd.commands.status`, which both read it. (``status`` 20 s into a 4-job sweep said "0 running, 3
missing" and offered a resume command that would have run them twice.)"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

SWEEP_LOCK = ".sweep.lock"  # held by the process that launched a sweep, for as long as it runs (SweepEnd)
SWEEP_RECORD = ".sweep.json"  # who holds it: host, pid, start time (what status and a second launch say)
HELD: dict = {}  # "sweep": the FileLock this process holds on the sweep it is launching


def hold_sweep(sweep_dir: Path) -> None:
    """This process is launching the sweep in ``sweep_dir``: it holds ``.sweep.lock`` until the sweep ends (or
    the process does: the OS releases a dead process's lock) and records who it is in ``.sweep.json``. A sweep
    another live process is running is refused (a :class:`~specmd.errors.ConfigError` naming it): launching the
    resume command twice would run its pending jobs in two processes."""
    from filelock import FileLock, Timeout

    from .errors import ConfigError
    from .results import write_json_atomic

    sweep_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(sweep_dir / SWEEP_LOCK))
    try:
        lock.acquire(timeout=2)  # (a status probe holds it for an instant)
    except Timeout:
        raise ConfigError(f"hydra.sweep.dir={sweep_dir} is being run by {sweep_runner(sweep_dir)}: wait for it to "
                          f"end (specmd status {sweep_dir}) or stop that process; a second launch would run its "
                          "pending jobs twice") from None
    HELD["sweep"] = lock
    write_json_atomic(sweep_dir / SWEEP_RECORD, {"host": socket.gethostname(), "pid": os.getpid(),
                                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}, keep=False)


def release_sweep() -> None:
    """The sweep this process launched has ended (or failed): its lock goes."""
    lock = HELD.pop("sweep", None)
    if lock is not None:
        lock.release()


def sweep_live(sweep_dir: Path) -> bool:
    """Whether a live process is launching the sweep in ``sweep_dir`` (its ``.sweep.lock`` is held)."""
    from filelock import FileLock, Timeout

    path = Path(sweep_dir) / SWEEP_LOCK
    if not path.exists():
        return False
    try:
        with FileLock(str(path)).acquire(timeout=0):
            return False
    except Timeout:
        return True
    except OSError:  # a lock this user cannot open: not a process of ours
        return False


def sweep_runner(sweep_dir: Path) -> str:
    """``pid N on host H since T`` from ``.sweep.json`` (``another process`` when it cannot be read)."""
    try:
        r = json.loads((Path(sweep_dir) / SWEEP_RECORD).read_text())
        return f"pid {r['pid']} on {r['host']} since {r['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"
