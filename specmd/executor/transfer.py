"""The transfer channel of ``execution=offload``: one small interface, :class:`Mover`, with a CPU
implementation (a transfer thread: what SpecMD's watchdog thread does, App. A.3) and a CUDA one (a side
stream, pinned bounce buffers and events; Fiddler's and MoE-PolicyLang's mechanism).

A job is a callable that copies ``count`` experts' bytes into their destinations (the tier knows how: a
memmove or tensor copy from host memory, or reads from the checkpoint file): one expert (a prefetch), or a
layer call's demand fetches back to back (one hand-off to the transfer thread for all of them: per job the
hand-off costs tens of us, more than a 49 kB expert's copy). The mover runs jobs one at a time, demand jobs
before queued prefetches (the simulated channel's order: non-preemptive, demand first), paces each to the
link (``count * latency + nbytes / bandwidth``: the simulated channel's ``count`` transfers back to back,
SpecMD's software throttle) when throttling is on, and counts experts, bytes and busy seconds. :class:`Ticket` is the handle: ``done()`` polls, :meth:`Mover.wait` blocks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional


class TransferError(RuntimeError):
    """A transfer failed (an unreadable or truncated checkpoint file, a missing expert): the run fails."""


class Ticket:
    __slots__ = ("job", "nbytes", "count", "state", "error", "issued", "started", "finished", "what", "event", "after")

    QUEUED, RUNNING, DONE, CANCELLED = 0, 1, 2, 3

    def __init__(self, job: Callable[[], None], nbytes: int, what: str, count: int = 1):
        self.job = job
        self.nbytes = nbytes
        self.count = count  # experts the job copies
        self.state = Ticket.QUEUED
        self.error: Optional[BaseException] = None
        self.issued = time.perf_counter()
        self.started = self.finished = 0.0
        self.what = what  # "layer 3 expert 17 (int4)": named in errors
        self.event = None  # CUDA: the event recorded after the copies (compute waits on it, not the host)
        self.after = None  # CUDA: the compute stream's event the copies wait for (Mover.mark)

    def done(self) -> bool:
        return self.state >= Ticket.DONE


class Mover:
    """Runs copy jobs in order on one channel. ``submit(job, nbytes, demand, what, count)`` -> :class:`Ticket`."""

    def __init__(self, bandwidth_bytes_per_s: Optional[float], latency_s: float = 0.0):
        self.bw = bandwidth_bytes_per_s  # None: unthrottled (what the machine does)
        self.latency = latency_s
        self.bytes_moved = 0
        self.busy_s = 0.0  # seconds the channel was busy (including throttle pacing)
        self.copy_s = 0.0  # seconds spent in the copies themselves
        self.transfers = 0  # experts moved (a job of ``count`` experts counts ``count``)
        self.jobs = 0
        self._stop = threading.Event()  # set by close(): a paced wait ends at once (a slow link's 100 s sleep)

    def submit(self, job: Callable[[], None], nbytes: int, demand: bool, what: str = "", count: int = 1,
               after=None) -> Ticket:
        """Queue ``job`` (``count`` experts, ``nbytes``); ``after``: a :meth:`mark` its copies must follow."""
        raise NotImplementedError

    def mark(self):
        """The compute work issued so far, for a later copy to wait on (CUDA: an event on the compute stream;
        a CPU copy runs after the compute that preceded it anyway: None)."""
        return None

    def promote(self, ticket: Ticket) -> None:
        """A queued prefetch is needed now: move it to the front of the queue."""

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a queued job (its slot is being freed); False if it already started (then wait for it)."""
        return False

    def wait(self, ticket: Ticket) -> float:
        """Block until ``ticket`` is done; returns the seconds waited. Raises :class:`TransferError` if it
        failed."""
        raise NotImplementedError

    def acquire(self, ticket: Ticket) -> float:
        """Compute is about to read what ``ticket`` copies: promote it if still queued and wait for it (on
        CUDA: until its copies are issued, then the compute stream waits on its event -- the host does not);
        returns the seconds the host waited. Raises :class:`TransferError` if it failed."""
        if ticket.state >= Ticket.DONE:
            if ticket.error is not None:
                self.wait(ticket)  # raises, naming the expert
            return 0.0
        self.promote(ticket)
        return self.wait(ticket)

    def sync(self) -> None:
        """Every copy of a job already done has landed (on CUDA, where done means issued, the side stream is
        waited for: benchmarks and checks only, never the hot path)."""

    def landed(self, ticket: Ticket) -> float:
        """Block until ``ticket``'s copies have landed; the ``time.perf_counter()`` at which they had (a CPU
        copy: when the transfer thread finished it). Measurements only (calibrate), never the hot path."""
        self.wait(ticket)
        return ticket.finished

    def close(self) -> None:
        pass

    def _pace(self, t0: float, nbytes: int, count: int = 1) -> None:
        """Hold the channel until ``t0 + count * latency + nbytes / bandwidth`` (busy-wait the last 200 µs:
        sleep granularity would otherwise add its own latency)."""
        if self.bw is None:
            return
        target = t0 + count * self.latency + nbytes / self.bw
        while True:
            left = target - time.perf_counter()
            if left <= 0:
                return
            if left > 2e-4 and self._stop.wait(left - 1.5e-4):
                return  # closing: the run stops (a signal, an error) and must not wait out the link


class ThreadMover(Mover):
    """The CPU implementation: one daemon transfer thread (copies release the GIL, so they overlap the
    model's compute on another core)."""

    def __init__(self, bandwidth_bytes_per_s: Optional[float], latency_s: float = 0.0, plan=None):
        super().__init__(bandwidth_bytes_per_s, latency_s)
        self._plan = plan  # the run's :class:`~specmd.machine.CorePlan`: the thread moves to its copy cores
        self._demand: deque[Ticket] = deque()
        self._prefetch: deque[Ticket] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="specmd-transfer", daemon=True)
        self._thread.start()

    def submit(self, job, nbytes, demand, what="", count=1, after=None):
        t = Ticket(job, nbytes, what, count)
        t.after = after
        with self._cv:
            (self._demand if demand else self._prefetch).append(t)
            self._cv.notify_all()
        return t

    def promote(self, ticket):
        with self._cv:
            if ticket.state == Ticket.QUEUED:
                try:
                    self._prefetch.remove(ticket)
                except ValueError:
                    return
                self._demand.appendleft(ticket)  # compute needs it now: before the call's later demand jobs

    def cancel(self, ticket):
        with self._cv:
            if ticket.state != Ticket.QUEUED:
                return False
            for q in (self._prefetch, self._demand):
                try:
                    q.remove(ticket)
                    break
                except ValueError:
                    continue
            ticket.state = Ticket.CANCELLED
            self._cv.notify_all()
            return True

    def wait(self, ticket):
        if ticket.state >= Ticket.DONE:
            if ticket.error is not None:
                self._raise(ticket)
            return 0.0
        t0 = time.perf_counter()
        with self._cv:
            while ticket.state < Ticket.DONE:
                if self._closed:
                    raise TransferError(f"transfer of {ticket.what}: the transfer thread stopped")
                self._cv.wait(0.5)  # woken by the transfer thread; the timeout lets SIGTERM/SIGINT be handled
        if ticket.error is not None:
            self._raise(ticket)
        return time.perf_counter() - t0

    @staticmethod
    def _raise(ticket):
        if isinstance(ticket.error, TransferError):  # a batch job names the expert that failed itself
            raise ticket.error
        raise TransferError(f"transfer of {ticket.what} failed: {ticket.error}") from ticket.error

    def _loop(self):
        if self._plan is not None:
            self._plan.enter_helper("copy")
        cv = self._cv
        while True:
            with cv:
                while not self._demand and not self._prefetch and not self._closed:
                    cv.wait()
                if self._closed:
                    return
                t = self._demand.popleft() if self._demand else self._prefetch.popleft()
                t.state = Ticket.RUNNING
            t0 = time.perf_counter()
            t.started = t0
            try:
                self._run_job(t)
                c = time.perf_counter()
                self.copy_s += self._copy_seconds(t, t0, c)
                self._pace(t0, t.nbytes, t.count)
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiter, who fails the run with it
                t.error = exc
            t.finished = time.perf_counter()
            self.busy_s += t.finished - t0
            self.bytes_moved += t.nbytes
            self.transfers += t.count
            self.jobs += 1
            t.job = None
            with cv:
                t.state = Ticket.DONE
                cv.notify_all()

    def _run_job(self, ticket: Ticket) -> None:
        ticket.job()

    def _copy_seconds(self, ticket: Ticket, t0: float, t1: float) -> float:
        """The seconds the job's copies took (a CPU copy: the job's own time)."""
        return t1 - t0

    def close(self):
        self._stop.set()  # a paced transfer stops waiting out the link
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()  # a read under way finishes before the tier closes its files


class CudaMover(ThreadMover):
    """The CUDA implementation. The same transfer thread issues each job's host->device copies with
    ``non_blocking=True`` on a dedicated side stream from pinned host memory and records an event after them;
    the job is done when its copies are *issued* (unthrottled) -- the compute stream then waits on the event
    (:meth:`acquire`), so the host never waits for a copy to land. Throttled (emulating a slower link), the
    thread waits for the event and paces, as on the CPU, and compute waits for the paced end. Before a job
    writes a slot, the side stream waits for the kernels that may still read it (``after``: the event its
    submitter marked, :meth:`mark`; without one, all compute issued so far); copies into one slot are ordered
    by the side stream itself.
    The copies' own time comes from timing events, read when they have completed (never waited for)."""

    def __init__(self, bandwidth_bytes_per_s, latency_s, accel, plan=None):
        self.accel = accel  # :class:`specmd.accel.Accel`: torch.cuda, or the CPU stand-in of the tests
        self.stream = accel.Stream()
        self.compute = accel.current_stream()
        self._timed: deque = deque()  # (start event, end event) of jobs whose copy time is not yet counted
        super().__init__(bandwidth_bytes_per_s, latency_s, plan)

    def _run_job(self, ticket) -> None:
        accel, stream = self.accel, self.stream
        if ticket.after is not None:  # the kernels that may read what it overwrites (not all compute since)
            stream.wait_event(ticket.after)
        else:
            stream.wait_stream(self.compute)
        start, end = accel.Event(timing=True), accel.Event(timing=True)
        with accel.stream(stream):
            start.record(stream)
            ticket.job()
            end.record(stream)
        ticket.event = end
        self._timed.append((start, end))
        if self.bw is not None:  # pacing starts from the copy's real end: the transfer thread waits, compute not
            end.synchronize()

    def _copy_seconds(self, ticket, t0, t1) -> float:
        done = 0.0
        timed = self._timed
        while timed and timed[0][1].query():  # (a query, not a wait)
            start, end = timed.popleft()
            done += start.elapsed_time(end) / 1e3
        return done

    def sync(self) -> None:
        self.stream.synchronize()

    def landed(self, ticket) -> float:
        self.wait(ticket)
        if ticket.event is not None:
            ticket.event.synchronize()  # done meant issued: the copies land here
        return time.perf_counter()

    def mark(self):
        ev = self.accel.Event()
        ev.record(self.compute)
        return ev

    def settle(self) -> None:
        """Count the copy time of every job issued so far (waits for the side stream: results only)."""
        self.stream.synchronize()
        for start, end in self._timed:
            self.copy_s += start.elapsed_time(end) / 1e3
        self._timed.clear()

    def acquire(self, ticket) -> float:
        waited = super().acquire(ticket)
        if ticket.event is not None:
            self.compute.wait_event(ticket.event)  # the kernels that read these copies wait, on the device
        return waited

    def close(self):
        super().close()
        self.settle()  # the copies not yet counted (the run's end: nothing else waits)


def make_mover(device, bandwidth_bytes_per_s: Optional[float], latency_s: float = 0.0, plan=None) -> Mover:
    """The transfer channel for ``device`` (the one place it is chosen): :class:`CudaMover` where the device has
    an accelerator (:func:`specmd.accel.accel_for`: CUDA, or its CPU stand-in), else :class:`ThreadMover`."""
    from ..accel import accel_for

    accel = accel_for(device)
    if accel is not None:
        return CudaMover(bandwidth_bytes_per_s, latency_s, accel, plan)
    return ThreadMover(bandwidth_bytes_per_s, latency_s, plan)
