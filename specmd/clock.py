"""Deterministic simulated clock: one host->device transfer channel plus a roofline compute model.

Time only moves when the hook tells it to (compute of a layer, a stall on a transfer), so a run is
deterministic for a given config and input. The channel is non-preemptive and serves demand fetches
before *queued* prefetches (SpecMD's watchdog thread issues prefetches asynchronously; a demand miss
blocks compute). A prefetch that already started keeps the channel until it completes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

INF = math.inf


class Transfer:
    """A prefetch waiting on or travelling through the channel. ``ready_at`` is INF until it starts."""

    __slots__ = ("nbytes", "issued_at", "ready_at", "started")

    def __init__(self, nbytes: int, issued_at: float):
        self.nbytes = nbytes
        self.issued_at = issued_at
        self.ready_at = INF
        self.started = False


class TransferChannel:
    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float):
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        self.bw = float(bandwidth_bytes_per_s)
        self.latency = float(latency_s)
        self.free_at = 0.0  # when the transfer occupying the channel completes
        self.queue: deque[Transfer] = deque()
        self.busy_s = 0.0

    def duration(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bw

    def _start(self, tr: Transfer, at: float) -> None:
        d = self.duration(tr.nbytes)
        tr.started = True
        tr.ready_at = at + d
        self.free_at = tr.ready_at
        self.busy_s += d

    def advance(self, t: float) -> None:
        """Start every queued prefetch whose start time falls strictly before ``t``."""
        q = self.queue
        while q:
            start = max(self.free_at, q[0].issued_at)
            if start >= t:
                break
            self._start(q.popleft(), start)

    def submit(self, tr: Transfer) -> None:
        """Queue an asynchronous prefetch (served after earlier queued ones, after demand)."""
        self.queue.append(tr)

    def demand(self, t: float, nbytes: int) -> float:
        """A blocking fetch requested at ``t``: returns its completion time."""
        self.advance(t)
        start = max(t, self.free_at)
        d = self.duration(nbytes)
        self.free_at = start + d
        self.busy_s += d
        return self.free_at

    def promote(self, tr: Transfer, t: float) -> float:
        """A queued prefetch is now needed: if it has not started, serve it as a demand fetch."""
        self.advance(t)
        if tr.started:
            return tr.ready_at
        self.queue.remove(tr)
        tr.issued_at = t
        start = max(t, self.free_at)
        self._start(tr, start)
        return tr.ready_at

    def cancel(self, tr: Transfer) -> bool:
        """Drop a prefetch that has not started (its bytes never move). Returns True if cancelled."""
        if tr.started:
            return False
        self.queue.remove(tr)
        return True


@dataclass(frozen=True)
class Roofline:
    """time(op) = max(flops / peak, bytes / memory bandwidth)."""

    peak_flops: float
    mem_bytes_per_s: float

    def time(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.mem_bytes_per_s)


class SimClock:
    """Simulated time plus per-pass bookkeeping for TTFT / TPOT."""

    def __init__(self, channel: TransferChannel, roofline: Roofline):
        self.channel = channel
        self.roofline = roofline
        self.now = 0.0
        self.stall_s = 0.0
        self.compute_s = 0.0

    def compute(self, flops: float, nbytes: float) -> None:
        dt = self.roofline.time(flops, nbytes)
        self.now += dt
        self.compute_s += dt

    def wait_until(self, t: float) -> float:
        """Stall compute until ``t``; returns the stall added."""
        if t > self.now:
            dt = t - self.now
            self.now = t
            self.stall_s += dt
            return dt
        return 0.0
