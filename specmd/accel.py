"""The accelerator's calls -- streams, events, pinned host memory, synchronisation, asynchronous copies -- behind
one small interface, so that every CUDA branch of the offload executor, the read-back and calibrate runs in
the tests on a CPU.

:func:`accel_for` is the one place a device's accelerator is chosen: ``None`` on a CPU (every caller then takes
its CPU branch: memmove copies, a transfer thread, no events), :class:`Cuda` on a CUDA device (``torch.cuda``
itself), and :class:`StandIn` on a CPU device when ``SPECMD_CUDA_STANDIN=1`` (or inside :func:`stand_in`):
CPU tensors with a GPU's *ordering* semantics, and a log of every call.

The stand-in's semantics (what makes a missing wait visible in the tests, not only in the log):

- the **compute stream** runs eagerly: a kernel on it has finished when the call returns, as the CPU runs it;
- a **side stream** defers: a copy issued on it (:meth:`Accel.copy_` while it is the thread's current stream)
  is queued, and lands only when something waits for it -- the compute stream's ``wait_event`` /
  ``wait_stream``, an event's or the stream's ``synchronize``, or :meth:`Accel.synchronize`. A kernel that
  reads a slot whose copy it never waited for reads the slot's *old* bytes, and offload stops being bit-equal
  with the simulated run;
- an event records its stream's position; ``query()`` is true once the stream has run past it;
  ``elapsed_time`` is the host time between the moments the two positions were run (order only: the
  stand-in's times mean nothing about a GPU's);
- memory is never pinned (torch cannot pin without CUDA): :attr:`Accel.pin` is False, the call logged.

The log (:attr:`StandIn.log`) is a list of tuples: ``("copy", stream, nbytes)``, ``("record", event, stream)``,
``("wait", stream, event)``, ``("wait_stream", stream, other)``, ``("sync", what, id)``, ``("land", stream,
n)`` (queued copies run), ``("pin", nbytes)``. Tests check it for the order of copies and waits.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import deque

import torch

ENV = "SPECMD_CUDA_STANDIN"


class Accel:
    """The calls specmd makes of an accelerator (the subset of ``torch.cuda`` it uses, plus :meth:`copy_` and
    :attr:`pin`). ``device``: the ``torch.device`` tensors live on."""

    name = "cuda"
    pin = True  # host buffers the device copies from or into are page-locked (``pin_memory=``)

    def __init__(self, device: torch.device):
        self.device = device

    def Stream(self):
        return torch.cuda.Stream(device=self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def stream(self, s):
        """Context: ``s`` is this thread's current stream (``torch.cuda.stream``)."""
        return torch.cuda.stream(s)

    def Event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device's memory (``torch.cuda.mem_get_info``): what
        ``hardware.capacity=auto`` sizes the cache from."""
        return torch.cuda.mem_get_info(self.device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, blocking: bool = False) -> None:
        """A copy on the thread's current stream: asynchronous (from pinned memory: a DMA), or ``blocking`` (the
        host waits for it and what the stream issued before it: a bounce buffer about to be reused)."""
        dst.copy_(src, non_blocking=not blocking)

    def empty_host(self, *shape, dtype) -> torch.Tensor:
        """Host memory the device copies from or into (pinned where :attr:`pin`)."""
        return torch.empty(*shape, dtype=dtype, pin_memory=self.pin)


Cuda = Accel  # (the real accelerator is torch.cuda's own calls)


class _Stream:
    __slots__ = ("id", "eager", "ops", "issued", "ran", "owner")

    def __init__(self, owner: "StandIn", sid: int, eager: bool):
        self.owner, self.id, self.eager = owner, sid, eager
        self.ops: deque = deque()  # queued copies (callables), in issue order
        self.issued = self.ran = 0  # positions: ops issued, ops run

    def wait_event(self, ev: "_Event") -> None:
        o = self.owner
        with o.lock:
            o.log.append(("wait", self.id, ev.id))
            if self.eager:  # compute waits: what the event covers lands now
                o._run(ev.stream, ev.pos)
            # (a side stream waiting on compute: compute ran eagerly, nothing to do)

    def wait_stream(self, other: "_Stream") -> None:
        o = self.owner
        with o.lock:
            o.log.append(("wait_stream", self.id, other.id))
            if self.eager:
                o._run(other, other.issued)

    def synchronize(self) -> None:
        o = self.owner
        with o.lock:
            o.log.append(("sync", "stream", self.id))
            o._run(self, self.issued)

    def query(self) -> bool:
        with self.owner.lock:
            return self.ran >= self.issued


class _Event:
    __slots__ = ("id", "owner", "stream", "pos", "stamp", "timing")

    def __init__(self, owner: "StandIn", eid: int, timing: bool):
        self.owner, self.id, self.timing = owner, eid, timing
        self.stream, self.pos, self.stamp = None, 0, None

    def record(self, stream: _Stream | None = None) -> None:
        o = self.owner
        with o.lock:
            s = stream if stream is not None else o.current_stream()
            self.stream, self.pos, self.stamp = s, s.issued, None
            o.log.append(("record", self.id, s.id))
            if s.ran >= s.issued:
                self.stamp = time.perf_counter()
            else:
                o._stamps.append(self)

    def synchronize(self) -> None:
        o = self.owner
        with o.lock:
            o.log.append(("sync", "event", self.id))
            if self.stream is not None:
                o._run(self.stream, self.pos)

    def query(self) -> bool:
        with self.owner.lock:  # (a flush under way on another thread has run past it only when it is stamped)
            return self.stream is None or self.stream.ran >= self.pos

    def elapsed_time(self, end: "_Event") -> float:
        """Milliseconds between the two events' positions being run (both must have completed, as on CUDA)."""
        with self.owner.lock:
            if self.stamp is None or end.stamp is None:
                raise RuntimeError("elapsed_time on an event that has not completed (CUDA raises here too)")
            return max(0.0, (end.stamp - self.stamp) * 1e3)


class StandIn(Accel):
    """A CUDA device's ordering on a CPU, with a log of every call (the module's doc)."""

    name = "cuda stand-in"
    pin = False

    def __init__(self, device: torch.device | None = None):
        super().__init__(torch.device("cpu") if device is None else device)
        self.lock = threading.RLock()
        self.log: list = []
        self._ids = itertools.count()
        self.compute = _Stream(self, next(self._ids), eager=True)
        self.streams: list = []
        self._local = threading.local()
        self._stamps: list = []  # events whose position has not run yet

    # -- the interface
    def Stream(self):
        with self.lock:
            s = _Stream(self, next(self._ids), eager=False)
            self.streams.append(s)
            self.log.append(("stream", s.id))
            return s

    def current_stream(self):
        return getattr(self._local, "stream", None) or self.compute

    @contextlib.contextmanager
    def stream(self, s):
        prev = getattr(self._local, "stream", None)
        self._local.stream = s
        try:
            yield s
        finally:
            self._local.stream = prev

    def Event(self, timing: bool = False):
        with self.lock:
            return _Event(self, next(self._ids), timing)

    # the stand-in's device memory (GiB; SPECMD_STANDIN_MEMORY_GB, default an 80 GB GPU's), all of it free
    MEMORY_ENV = "SPECMD_STANDIN_MEMORY_GB"

    def mem_get_info(self) -> tuple[int, int]:
        import os

        total = int(float(os.environ.get(self.MEMORY_ENV, "80")) * (1 << 30))
        with self.lock:
            self.log.append(("mem_get_info", None, None))
        return total, total

    def synchronize(self) -> None:
        with self.lock:
            self.log.append(("sync", "device", None))
            for s in self.streams:
                self._run(s, s.issued)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, blocking: bool = False) -> None:
        s = self.current_stream()
        if s.eager:
            dst.copy_(src)
            return
        with self.lock:
            if blocking:  # in stream order: what the stream issued first lands first
                self.log.append(("sync", "copy", s.id))
                self._run(s, s.issued)
                dst.copy_(src)
                return
            s.ops.append((dst, src))
            s.issued += 1
            self.log.append(("copy", s.id, dst.numel() * dst.element_size()))

    def empty_host(self, *shape, dtype) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dtype)
        with self.lock:
            self.log.append(("pin", t.numel() * t.element_size()))
        return t

    # -- the machinery
    def _run(self, s: _Stream, pos: int) -> None:
        """Run ``s``'s queued copies up to position ``pos`` (under the lock). An event waiting for a position is
        stamped as the copies reach it -- before the next one runs -- so two events around copies time the copies
        themselves (stamping them all after the last copy made their elapsed time 0: calibrate's small copies then
        measured 1e25 GB/s, an intermittent failure of the stand-in's calibrate)."""
        n = 0
        while s.ran < pos:
            self._stamp(s)
            dst, src = s.ops.popleft()
            dst.copy_(src)
            s.ran += 1
            n += 1
        if n:
            self.log.append(("land", s.id, n))
            self._stamp(s)

    def _stamp(self, s: _Stream) -> None:
        """The events of ``s`` whose position has run, stamped now."""
        if not self._stamps:
            return
        now = time.perf_counter()
        keep = []
        for ev in self._stamps:
            if ev.stream is s and s.ran >= ev.pos:
                ev.stamp = now
            else:
                keep.append(ev)
        self._stamps = keep

    def pending(self) -> int:
        """Copies issued and not yet landed (a finished run leaves none behind)."""
        return sum(s.issued - s.ran for s in self.streams)

    def count(self, kind: str, what=None) -> int:
        return sum(1 for e in self.log if e[0] == kind and (what is None or e[1] == what))


def host_buffer(accel: Accel | None, *shape, dtype) -> torch.Tensor:
    """Host memory the device copies from or into: pinned where ``accel`` pins (:meth:`Accel.empty_host`), plain
    on a CPU (``accel`` None)."""
    return accel.empty_host(*shape, dtype=dtype) if accel is not None else torch.empty(*shape, dtype=dtype)


_STANDIN: StandIn | None = None  # the process's stand-in (one device: every caller sees the same streams)


def standin() -> StandIn:
    """The process's stand-in (made on first use)."""
    global _STANDIN
    if _STANDIN is None:
        _STANDIN = StandIn()
    return _STANDIN


def standin_active() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


@contextlib.contextmanager
def stand_in():
    """Run the CUDA branches on the CPU inside the block (a fresh :class:`StandIn`, yielded for its log)."""
    global _STANDIN
    prev_env, prev = os.environ.get(ENV), _STANDIN
    os.environ[ENV] = "1"
    _STANDIN = StandIn()
    try:
        yield _STANDIN
    finally:
        _STANDIN = prev
        if prev_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = prev_env


def accel_for(device) -> Accel | None:
    """The accelerator of ``device``: :class:`Cuda` for a CUDA device, the :class:`StandIn` for a CPU device when
    ``SPECMD_CUDA_STANDIN=1``, else ``None`` (the CPU branches)."""
    device = torch.device(device)
    if device.type == "cuda":
        return Cuda(device)
    if device.type == "cpu" and standin_active():
        return standin()
    return None
