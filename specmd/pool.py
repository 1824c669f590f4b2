"""Many configurations replayed over one decoded trace, on every core: what ``specmd mrc``, ``specmd tune``
and ``benchmarks/replay.py``'s sweep run. An orchestration of the replay driver (:mod:`specmd.replay.driver`),
so it sits beside the app, not in the driver package (``tests/system/test_layering.py``).

A replay is one core's work (the engine is sequential), and a study is many replays of the same trace.
:func:`replay_many` decodes nothing per configuration: the forked workers inherit the parent's trace
(memory-mapped arrays and the requests per call, copy-on-write), take the next configuration as soon as
they finish one (a ``score`` replay costs five LRU replays, so a fixed deal would leave a core idle), and
send back only each replay's results dict. The results are those of replaying the configurations one by
one in this process, in the order given (tested), whatever ``jobs`` is.

Fork is what makes the trace free to share; where the platform has no fork (Windows) the configurations
run one by one in this process.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Optional

import numpy as np

# What the forked workers inherit: (trace, specs, ptr, experts), set by replay_many for the pool's life.
_SHARED: list = []


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity where the platform reports one)."""
    from .jobs import usable_cores

    return usable_cores()


def check_jobs(jobs) -> int:
    """``jobs`` as a positive int, else a ValueError naming it (the callers turn it into a ConfigError)."""
    if isinstance(jobs, bool) or not isinstance(jobs, (int, np.integer)) or jobs < 1:
        raise ValueError(f"jobs={jobs!r} must be a positive integer (the processes to replay in; this machine "
                         f"has {default_jobs()} cores)")
    return int(jobs)


def _one(i: int) -> dict:
    from .replay.driver import build_engine, run_replay

    trace, specs, ptr, experts = _SHARED
    engine, _, _ = build_engine(trace, specs[i], ptr, experts)
    return run_replay(trace, specs[i], engine, ptr, experts).results()


def _worker_init() -> None:
    import signal

    import torch

    from .signals import ENDING

    torch.set_num_threads(1)  # one process per core: a policy's torch ops must not spawn threads of their own
    # the handler a worker inherits from the parent (specmd.signals.signals_raise) printed a traceback per worker.
    # A worker dies quietly on SIGINT (Ctrl-C reaches the whole process group) and SIGTERM (the pool's terminate):
    # the parent reports the signal once and terminates the pool. specmd's handler of the other ending signals
    # becomes "ignore" (a closed terminal's SIGHUP reaches the group too: the parent acts on it); a signal the parent
    # ignores (nohup) or leaves at its default stays so -- a worker dying of SIGHUP under nohup left Pool.map
    # waiting forever
    for s in ENDING:
        if s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        elif getattr(signal.getsignal(s), "specmd", False):
            signal.signal(s, signal.SIG_IGN)


def replay_many(trace, specs: list, jobs: Optional[int] = None) -> list[dict]:
    """``run_replay(trace, spec).results()`` for each of ``specs``, in their order, on ``jobs`` processes
    (default: every core; never more processes than configurations). Each spec is checked against the
    trace (:func:`~specmd.replay.driver.check`) before any replay starts, so a bad one fails the whole
    study at once instead of after hours."""
    from .replay.driver import check, requested_per_call

    jobs = default_jobs() if jobs is None else check_jobs(jobs)
    for spec in specs:
        check(trace, spec)
    ptr, experts = requested_per_call(trace, trace.meta.geometry.num_experts)  # once for every configuration
    _SHARED[:] = [trace, list(specs), ptr, experts]
    try:
        jobs = min(jobs, len(specs))
        if jobs <= 1 or "fork" not in mp.get_all_start_methods():
            return [_one(i) for i in range(len(specs))]
        with mp.get_context("fork").Pool(jobs, initializer=_worker_init) as pool:
            return pool.map(_one, range(len(specs)), chunksize=1)
    finally:
        _SHARED.clear()
