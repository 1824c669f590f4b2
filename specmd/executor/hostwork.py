"""The host computing experts beside the device (``miss=cpu_compute``, ``hybrid``): one worker thread.

The engine sends some misses to the host (:class:`~specmd.engine.outcomes.HostComputed`); its clock runs that
work on a resource of its own, beside the link and the device's compute (:class:`~specmd.engine.clock.SimClock`).
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
from typing import Callable

import torch


class HostWorker:
    """One thread that computes host banks; ``busy_s`` its time computing, ``runs`` the banks it computed."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specmd-host")
        self.busy_s = 0.0
        self.runs = 0

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on the worker, under the caller's autograd mode (a thread-local setting)."""
        return self._pool.submit(self._timed, fn, args, torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    def _timed(self, fn: Callable, args: tuple, grad: bool, inference: bool):
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.runs += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
