"""The link: the simulated transfer channel between the host's copy of the experts and the device
(:class:`TransferChannel`: one non-preemptive channel, demand fetches before queued prefetches), its
handles (:class:`Transfer`), and the rate a hardware profile gives it for copies of one expert
(:func:`copy_rate`, :func:`link_rate`: the offload executor paces its real copies to the same rate).
Only the simulated clock (:mod:`specmd.engine.simclock`) reads a transfer's arithmetic.
"""

from __future__ import annotations

import math
from collections import deque

INF = math.inf


class Transfer:
    """The simulated clock's handle: a transfer (or host work) waiting on or travelling through the channel.
    ``ready_at`` is INF until it starts; only :class:`SimClock` reads it."""


    def __init__(self, nbytes, issued_at: float):
        _fill(self, nbytes, issued_at)


def _fill(tr: Transfer, nbytes, issued_at: float) -> Transfer:
    tr.nbytes = nbytes
    tr.issued_at = issued_at
    tr.ready_at = INF
    tr.started = False
    return tr


def _new_transfer(nbytes, issued_at: float) -> Transfer:
    """A Transfer without a Python-level constructor call (the clock makes one per fetch)."""
    return _fill(Transfer.__new__(Transfer), nbytes, issued_at)


class TransferChannel:
    """One non-preemptive channel of ``bandwidth_bytes_per_s`` after ``latency_s`` per transfer: a demand fetch
    starts when the channel is free, queued prefetches start in order behind it. (Fields: ``link.pxd``.)"""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float):
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        self.bw = float(bandwidth_bytes_per_s)
        self.latency = float(latency_s)
        self.free_at = 0.0  # when the transfer occupying the channel completes
        self.queue: deque[Transfer] = deque()
        self.busy_s = 0.0
        self.last = None  # the prefetch that started last (a demand fetch has no object: None)

    def duration(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bw

    def _start(self, tr: Transfer, at: float) -> None:
        d = self.duration(tr.nbytes)
        tr.started = True
        tr.ready_at = at + d
        self.free_at = tr.ready_at
        self.busy_s += d
        self.last = tr

    def advance(self, t: float) -> None:
        """Start every queued prefetch whose start time falls strictly before ``t``."""
        q = self.queue
        while q:
            head = q[0]
            start = max(self.free_at, head.issued_at)
            if start >= t:
                break
            self._start(q.popleft(), start)

    def handle(self, nbytes, issued_at: float) -> Transfer:
        """A new handle of ``nbytes`` issued at ``issued_at`` (not queued: :meth:`submit` queues a prefetch;
        the clock's host work is a handle of 0 bytes that never enters the channel)."""
        return _new_transfer(nbytes, issued_at)

    def submit(self, tr: Transfer) -> None:
        """Queue an asynchronous prefetch (served after earlier queued ones, after demand)."""
        self.queue.append(tr)

    def demand(self, t: float, nbytes: float) -> float:
        """A blocking fetch requested at ``t``: returns its completion time."""
        if self.queue:
            self.advance(t)
        start = self.free_at if self.free_at > t else t  # (max(t, free_at), without a call per fetch)
        d = self.latency + nbytes / self.bw  # (duration(nbytes))
        self.free_at = start + d
        self.busy_s += d
        self.last = None
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


def copy_rate(bandwidth: float, small_bandwidth: float, small_bytes: float, unit: float) -> float:
    """Bytes/s of the link for copies of ``unit`` bytes (a model's expert): the first ``small_bytes`` of a copy
    at ``small_bandwidth``, the rest at ``bandwidth`` (``hardware.small_copy_gbps`` / ``small_copy_mb``; 0:
    ``bandwidth`` throughout). On this 2-core VM a copy reads at 9-18 GB/s up to 4-8 MiB and 6-8 GB/s
    beyond (a 35 MB Qwen expert), and one affine fit over 64 kB-32 MiB put the large copies at 0.6 of their
    time. The clock's channel runs at the rate of the model's expert size, an expert taken as one copy (the
    tier copies it one parameter at a time: a Qwen1.5-MoE expert's 23 and 12 MB, each past a few-MiB knee,
    come out within a few percent of one 35 MB copy; an expert whose parameters each fit under the knee and
    whose sum does not is priced a little slow)."""
    if small_bandwidth <= 0.0 or small_bytes <= 0.0 or unit <= 0.0:
        return bandwidth
    head = unit if unit < small_bytes else small_bytes
    return unit / (head / small_bandwidth + (unit - head) / bandwidth)


def link_rate(hw, unit: float) -> float:
    """A profile's link rate (bytes/s) for copies of ``unit`` bytes (:func:`copy_rate`): the clock's channel and
    the offload executor's pacing (``execution.throttle``) use the same."""
    return copy_rate(hw.bandwidth_gbps * 1e9, (getattr(hw, "small_copy_gbps", None) or 0.0) * 1e9,
                     (getattr(hw, "small_copy_mb", None) or 0.0) * 1e6, unit)
