"""The commands that are Hydra apps: ``run`` and ``sweep`` (specmd's run, :func:`specmd.app.execute`) and
``train`` (:mod:`specmd.commands.train`). Hydra reads its command line from ``sys.argv``, so each entry hands it the
command's arguments there; ``--help`` prints the command's usage, then Hydra's help of its config.

The run's job name stays ``__main__`` (``hydra.job.name`` in ``conf/config.yaml``): a run directory's log is
``__main__.log``, as before the commands moved here, and :mod:`specmd.sweeps` reads it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from .. import CONF_DIR
from ..errors import FULL_ERRNOS, PATH_ERRNOS
from ..jobs import OPENED, record_unrecorded
from ..liveness import release_sweep
from ..ending import kept_note
from .launch import SWEEP_EXIT, torch_threads

RUN = """usage: specmd run [key=value ...] [+key=value] [~key] [--cfg job|hydra|all] [--info]
       specmd [key=value ...]   python -m specmd [key=value ...]   (the same)

One run: the model (or, with replay.trace=PATH|record, a trace) under the cache stack the overrides compose;
writes results.json into its run directory (hydra.run.dir, default outputs/<date>/<time>-<host>-<pid>) and
prints a summary. Exit 0, 2 on a config or data error (one line; failed.json), 1 when a stage failed
(failed.json names it; HYDRA_FULL_ERROR=1 prints the traceback). Examples:
    specmd eviction=least_stale prefetch=score hardware.capacity=0.05
    specmd trace.save=true eval.limit=20          then    specmd replay.trace=<run dir>/trace eviction=lfu
"""

SWEEP = """usage: specmd sweep [key=v1,v2 ...] [+experiment=NAME] [hydra/launcher=...] [hydra.sweep.dir=DIR]
       specmd -m ...   python -m specmd -m ...   (the same)

A Hydra multirun: one run per combination of the comma-separated values (and of an experiment's sweep), each
in <sweep dir>/<its overrides>-<hash> (default sweep dir outputs/multirun/<date>/<time>-<host>-<pid>).
Resumable: launched again with hydra.sweep.dir=DIR it runs only the jobs not done. Exit 0 when every job is
done, 2 when only config or data errors failed jobs, 1 otherwise. Then: specmd status DIR, specmd report DIR.
Example:
    specmd sweep eviction=lru,lfu,least_stale hardware.capacity=0.05,0.1 replay.trace=<run dir>/trace
The overrides are a run's (below).
"""

TRAIN = """usage: specmd train [key=value ...] [--config-name train_deep_olmoe|train_deep_mixtral]
       python -m specmd.commands.train [...]   (the same)
"""


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig):
    """One job, in the process that runs it (a launcher's worker too): however it ends before
    :func:`specmd.app.execute` records it (its imports: torch's, a signal meanwhile), its directory says so."""
    try:
        return _job(cfg)
    except BaseException as exc:
        record_unrecorded(exc)
        raise


def _job(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from rich.console import Console
    from rich.markup import escape

    from ..app import JobRunning, execute
    from ..errors import ConfigError, DataError
    from ..summary import print_summary

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    multirun = hc.mode.name == "MULTIRUN"
    # a multirun's runs share a W&B group: its sweep directory's last two parts (<date>/<time> by default)
    group = "/".join(Path(hc.sweep.dir).parts[-2:])[-128:] if multirun else None  # (W&B's limit: 128)
    err = Console(stderr=True)
    try:
        # a sweep's job resumes: done with this config -> not run again (specmd.jobs)
        results = execute(cfg, run_dir=run_dir, group=group, resume=multirun, overrides=list(hc.overrides.task),
                          threads=torch_threads(None, OmegaConf.to_container(hc.launcher, resolve=True)))
    except JobRunning as exc:
        OPENED.pop("dir", None)  # another process's job: nothing of this process is ever written there
        err.print(f"[yellow]specmd: skipped:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return None
    except (ConfigError, DataError) as exc:  # failed.json is written; one clear line, no traceback
        err.print(f"[bold red]specmd: error:[/] {escape(str(exc) + kept_note(exc))}", highlight=False,
                  soft_wrap=True)
        if not multirun:
            raise SystemExit(2)
        return None  # one bad job fails itself, not the sweep (SweepEnd sets the exit code)
    except Exception as exc:  # model load, quantization, evaluation: failed.json names the stage, keeps the traceback
        if os.environ.get("HYDRA_FULL_ERROR") == "1":  # Hydra's own switch for the full trace
            raise
        from ..ending import classify

        stage = getattr(exc, "specmd_stage", "?")  # execute() knows it even when failed.json cannot be written
        where = getattr(exc, "specmd_failed", None) or f"{run_dir}/failed.json"
        code, message, bug = classify(exc)
        head = f"[bold red]specmd: {'job failed' if multirun else 'error'}[/] in stage {stage}: "
        if bug:
            err.print(head + f"{type(exc).__name__}: {escape(str(exc))}", highlight=False, soft_wrap=True)
            err.print(f"  the traceback is in {where} (HYDRA_FULL_ERROR=1 prints it)"
                      + ("; the sweep goes on" if multirun else ""), markup=False, highlight=False, soft_wrap=True)
        else:  # a file it could not write (a full disk, a read-only directory): one line naming it, no traceback
            err.print(head + escape(f"{message} (failed.json: {where})" + ("; the sweep goes on" if multirun else "")),
                      highlight=False, soft_wrap=True)
        if not multirun:
            raise SystemExit(code)
        return None
    if results.get("resumed"):
        Console().print(f"specmd: done already, not run again: {run_dir}/results.json (same config hash)",
                        highlight=False, soft_wrap=True)
    else:
        print_summary(results, run_dir, Console())
    return results.get("cache", {}) and results["cache"].get("hit_rate")


def asks_help(argv: list) -> bool:
    return "-h" in argv or "--help" in argv


def _as_hydra(app, argv: list) -> None:
    """``app()`` (a ``@hydra.main`` function) with ``argv`` as its command line; ``sys.argv`` and Hydra's
    global state as they were afterwards (a command run in-process, as the tests do, leaves nothing behind)."""
    from unittest import mock

    import hydra._internal.utils as hydra_utils
    from hydra.core.global_hydra import GlobalHydra

    saved = sys.argv[:]
    sys.argv[1:] = argv
    try:
        # a composition error (an unknown config group option, key or override syntax) reaches the dispatcher,
        # which prints it as one line with exit 2 (specmd.ending), not as Hydra's multi-line report, exit 1
        with mock.patch.object(hydra_utils, "run_and_report", _composition_errors_raise(hydra_utils.run_and_report)):
            app()
    finally:
        sys.argv[:] = saved
        GlobalHydra.instance().clear()


def _composition_errors_raise(run_and_report):
    """Hydra's ``run_and_report`` (which prints any exception and exits 1), except that Hydra's and
    OmegaConf's own errors -- the user's config and overrides --, specmd's checks in Hydra's callbacks (the
    run directory, the launcher's settings) and a file Hydra cannot write (a full disk: ``.hydra/``, the log,
    ``multirun.yaml``) propagate to specmd's one error path."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..errors import ConfigError, DataError

    def wrapped(func):
        caught = []

        def body():
            try:
                return func()
            except OSError as exc:
                caught.append(hydra_write_error(exc))
                return None
            except (HydraException, OmegaConfBaseException, ConfigError, DataError) as exc:
                caught.append(exc)
                return None

        result = run_and_report(body)
        if caught:
            raise caught[0]
        return result

    return wrapped


def hydra_write_error(exc: OSError) -> OSError:
    """An error of Hydra writing its record of a run (``.hydra/``, the log, ``multirun.yaml``) that names no file
    (a full disk fails the write when the file closes): it names the directory Hydra was writing into."""
    where = OPENED.get("dir") or OPENED.get("sweep")
    if exc.filename is not None or where is None or exc.errno not in FULL_ERRNOS | PATH_ERRNOS:
        return exc  # (a launcher's own trouble, ENOMEM starting workers, is not Hydra writing)
    error = OSError(exc.errno, f"{exc.strerror or exc} (Hydra writing its record of the run there)",
                    str(where))
    error.__cause__ = exc
    return error


def run(argv: list) -> int:
    """``specmd run`` (:data:`RUN`); a multirun when ``argv`` holds ``-m``."""
    if asks_help(argv):
        print(RUN)
    SWEEP_EXIT["code"] = 0  # (an earlier sweep in this process, as in the tests, does not set this one's)
    OPENED.clear()
    try:
        _as_hydra(_hydra_main, argv)  # a signal: Interrupted, reported by specmd.ending (failed.json names it)
    except BaseException as exc:
        record_unrecorded(exc)  # ended after its directory existed, before the job could say how
        raise
    finally:
        OPENED.clear()
        release_sweep()  # a sweep that failed or was stopped before its end (SweepEnd releases it at the end)
    return SWEEP_EXIT["code"]


def sweep(argv: list) -> int:
    """``specmd sweep`` (:data:`SWEEP`): the run with ``-m``."""
    if asks_help(argv):
        print(SWEEP)
        return run(argv)
    return run(argv if {"-m", "--multirun"} & set(argv) else ["-m", *argv])


def train(argv: list) -> int:
    """``specmd train``: :mod:`specmd.commands.train`'s Hydra app (``python -m specmd.commands.train``)."""
    from ..commands import train as module

    if asks_help(argv):
        print(TRAIN + "\n" + (module.__doc__ or "").strip() + "\n")
    _as_hydra(module.main, argv)
    return 0
