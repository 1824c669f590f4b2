"""The host computing experts (``miss=cpu_compute``, ``hybrid``): beside the device on a worker thread
(:class:`HostWorker`, a GPU's host CPU), or on the calling thread first in the layer call (:class:`InlineHost`,
a CPU device: ``execution.host_compute``).

The engine sends some misses to the host (:class:`~specmd.engine.outcomes.HostComputed`); its clock runs that
work on a resource of its own, beside the link and the device's compute (:class:`~specmd.engine.simclock.SimClock`).
The worker makes the measured run do the same: the layer call's host bank (the host tier's ``[E, ...]``
tensors, :meth:`~.tiers.RamTier.host_bank`) is handed to this thread as soon as the call's rows are known,
and the kernel computes the device's banks meanwhile (and the mover's copies keep landing); the call joins
it before the top-k sum (:func:`~.kernel.grouped_experts`). The thread runs the very ops the kernel would
(the same projection of the same rows), so on a CPU device the outputs keep the simulated run's bits; on
CUDA the rows are computed by the CPU from pinned host memory and uploaded, as Fiddler does (CPU arithmetic,
not the GPU's bits).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch


class HostWorker:
    """One thread that computes host banks; ``busy_s`` its time computing, ``runs`` the banks it computed."""

    def __init__(self, plan=None):
        # (``plan``: the run's :class:`~specmd.machine.CorePlan`: the thread moves to its host cores and computes
        # with its host_threads; None: the caller's thread count per bank)
        self._plan = plan
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specmd-host",
                                        initializer=None if plan is None else plan.enter_helper, initargs=("host",))
        self.busy_s = 0.0
        self.runs = 0
        self.calls: Optional[list] = None  # a list: each bank's (experts, rows, seconds) is appended (calibrate)

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on the worker, under the caller's autograd mode and the plan's host threads, else the
        caller's intra-op thread count (thread-local settings: a GEMM's summation order depends on how many
        threads split it, so with another count the worker's rows differed from the caller's in the last bits:
        ``execution.host_threads`` other than ``threads`` changes the host rows' last bits)."""
        threads = self._plan.host_threads if self._plan is not None else torch.get_num_threads()
        return self._pool.submit(self._timed, fn, args, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                                 threads)

    def _timed(self, fn: Callable, args: tuple, grad: bool, inference: bool, threads: int):
        t0 = time.perf_counter()
        try:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(*args)
        finally:
            _done(self, args, time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class InlineHost:
    """The host computing its bank on the calling thread, when the kernel reaches it (first: while the call's
    copies land): a CPU device, whose host *is* the device -- a second thread would only contend for the same
    cores (measured on 2 cores: the worker's hand-off cost ~160 us per call and the host's share of TTFT rose
    2.6x under contention). ``submit`` computes at once and returns a finished future."""

    def __init__(self, plan=None):  # (``plan``: the compute thread's, already applied)
        self.busy_s = 0.0
        self.runs = 0
        self.calls: Optional[list] = None  # (as HostWorker's)

    def submit(self, fn: Callable, *args) -> Future:
        f: Future = Future()
        t0 = time.perf_counter()
        try:
            f.set_result(fn(*args))
        finally:
            _done(self, args, time.perf_counter() - t0)
        return f

    def close(self) -> None:
        pass


def _done(host, args: tuple, seconds: float) -> None:
    """Account one bank computed: ``args`` are :func:`~.kernel.bank_where_it_is`'s (rows ``x``, groups ``ends``)."""
    host.busy_s += seconds
    host.runs += 1
    if host.calls is not None:
        ends = args[4]  # the looped variant's (end rows, slots), or the grouped one's end row per slot spanned
        n = len(ends[1]) if isinstance(ends, tuple) else int(torch.count_nonzero(torch.diff(ends, prepend=ends[:1] * 0)))
        host.calls.append((n, int(args[1].shape[0]), seconds))


HOST_COMPUTE = {"thread": HostWorker, "inline": InlineHost}
