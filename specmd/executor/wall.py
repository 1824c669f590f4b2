""":class:`WallClock`: the :class:`~specmd.engine.clock.Clock` interface on real time and real copies.

Its handles are tickets of a :class:`~specmd.executor.transfer.Mover` (a transfer thread on the CPU, a
side stream on CUDA): ``demand``/``prefetch`` issue a copy of ``nbytes`` through the mover (paced to the
link when it throttles), ``done`` polls the ticket, ``wait`` blocks and returns the seconds compute
actually waited, ``mark``/``since`` read ``time.perf_counter``; ``dense``/``experts``/``tail`` charge
nothing (the real kernels take the time). It shows the seam is clean -- the cache manager runs on it
unchanged (``tests/test_offload.py``) -- but decisions then depend on the machine's timing, so
``execution=offload`` keeps the deterministic :class:`SimClock` deciding and measures beside it.
"""

from __future__ import annotations

import time

import torch

from ..engine.clock import Clock
from .transfer import Mover, ThreadMover


class _Done:
    """A handle that is complete when issued (host work the executor performs synchronously)."""

    __slots__ = ()

    def done(self) -> bool:
        return True


class WallClock(Clock):
    name = "wall"

    def __init__(self, mover: Mover | None = None, bandwidth_bytes_per_s: float | None = None,
                 latency_s: float = 0.0, max_bytes: int = 1 << 24, host_s_per_slot: float = 0.0):
        self.mover = mover or ThreadMover(bandwidth_bytes_per_s, latency_s)
        self.bw = bandwidth_bytes_per_s
        self.latency = latency_s
        self._src = torch.empty(max_bytes, dtype=torch.uint8)  # the bytes a raw transfer moves (pre-allocated)
        self._dst = torch.empty(max_bytes, dtype=torch.uint8)
        self._t0 = time.perf_counter()
        self.stall_s = 0.0
        self.host_s_per_slot = host_s_per_slot

    @property
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def transfer_time(self, nbytes: int) -> float:
        return self.latency + (nbytes / self.bw if self.bw else 0.0)

    def _copy(self, nbytes: int, demand: bool):
        n = min(nbytes, self._src.numel())
        src, dst = self._src[:n], self._dst[:n]
        return self.mover.submit(lambda: dst.copy_(src), nbytes, demand, f"{nbytes} bytes")

    def demand(self, nbytes: int):
        return self._copy(nbytes, True)

    def prefetch(self, nbytes: int):
        return self._copy(nbytes, False)

    def promote(self, handle):
        self.mover.promote(handle)
        return handle

    def done(self, handle) -> bool:
        return handle.done()

    def wait(self, handles) -> float:
        t0 = time.perf_counter()
        for h in handles:
            if not h.done():
                self.mover.wait(h)
        dt = time.perf_counter() - t0
        self.stall_s += dt
        return dt

    def mark(self):
        return time.perf_counter(), self.stall_s

    def since(self, mark):
        return time.perf_counter() - mark[0], self.stall_s - mark[1]

    def host_time(self, slots: int, experts: int) -> float:
        return slots * self.host_s_per_slot

    def host(self, slots: int, experts: int):
        return _Done()

    def close(self) -> None:
        self.mover.close()
