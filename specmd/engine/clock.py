"""Timing: the clock owns time, the transfer channel, the device roofline and host compute.

The cache manager never reads or computes a time. Time is a **handle**: ``demand``, ``prefetch``,
``promote`` and ``host`` return one, the manager asks ``done(handle)`` (has it arrived?) and
``wait(handles)`` (stall compute until all have; returns the stall added), and ``mark``/``since`` give a
forward pass its duration and stall for the pass record. The engine charges compute through the clock
(``dense``, ``experts``, ``tail``). Policies read time only through the cache view (``transfer_time``,
``host_time``, ``device_time``, ``link_backlog``, ``host_backlog``, ``host_beside_device``: the cache view's
clock, :class:`~specmd.engine.view.ClockView`).

:class:`Clock` is the interface; :class:`~specmd.engine.simclock.SimClock` the deterministic simulated
clock that implements it (its transfer channel: :mod:`specmd.engine.link`; its roofline:
:mod:`specmd.engine.simclock`).
"""

from __future__ import annotations


class Clock:
    """What the engine needs from time: ``now`` and ``stall_s`` (seconds) are read by the engine's
    accounting. (A compiled extension type: the engine calls its methods without Python's call overhead; a
    Python subclass overrides any of them.)"""

    name = "abstract"

    # -- transfers --------------------------------------------------------------------------------
    def begin_layer(self):
        """A layer call starts serving at ``now`` (start whatever the channel would have started)."""

    def transfer_time(self, nbytes: int) -> float:
        raise NotImplementedError

    def demand(self, nbytes: int, placed: int = 1):
        """A blocking fetch issued now (demand priority); returns its handle (wait on it before computing), or
        None when the clock keeps track of it itself: then the next :meth:`wait` waits for it too, whatever
        handles it is given (the simulated clock: no object per fetch on the replay's hottest path).
        ``placed``: the experts it places (a slot each, or a staging row each: a streamed call's misses not
        staged ahead go as one demand of that many)."""
        raise NotImplementedError

    def prefetch(self, nbytes: int, placed: int = 1):
        """An asynchronous fetch issued now, queued behind earlier ones; returns its handle. ``placed``: as
        :meth:`demand`'s."""
        raise NotImplementedError

    def promote(self, handle):
        """A prefetch is needed now: serve it at demand priority if it has not started; returns its handle."""
        raise NotImplementedError

    def done(self, handle):
        """Whether ``handle``'s bytes (or host work) have arrived by now."""
        raise NotImplementedError

    def wait(self, handles) -> float:
        """Stall compute until every handle in ``handles`` is done; returns the stall added (seconds)."""
        raise NotImplementedError

    def mark(self):
        """An opaque mark of now, for :meth:`since` (a forward pass's start)."""
        raise NotImplementedError

    def since(self, mark):
        """(seconds elapsed, stall seconds added) since ``mark``."""
        raise NotImplementedError

    # -- compute ----------------------------------------------------------------------------------
    def host_time(self, slots: int, experts: int) -> float:
        """Seconds the host needs for ``slots`` token-expert pairs over ``experts`` experts."""
        raise NotImplementedError

    def predicted(self):
        """The prefetch policy made one prediction (a later layer's router on this layer's input)."""

    def host(self, slots, experts):
        """Host work issued now: it starts when the host is free (after the host work already queued), runs
        beside the link (and beside the device's compute where :meth:`host_beside_device`), and returns its
        handle (wait on it for its result)."""
        raise NotImplementedError

    def link_backlog(self) -> float:
        """Seconds from now until the link could start a demand fetch (the transfer occupying it finishes;
        queued prefetches wait behind demand)."""
        return 0.0

    def host_backlog(self) -> float:
        """Seconds from now until the host could start new work (the host work already queued finishes)."""
        return 0.0

    def busy(self) -> dict:
        """Each resource's busy seconds so far (``link_busy_s``, ``host_busy_s``), for the timing section."""
        return {}

    def host_beside_device(self) -> bool:
        """Whether host work runs beside the device's compute (a GPU and its host CPU: the layer's output waits
        for it after the device's experts) or on the same processor (a CPU: the device's experts wait for it,
        as for their transfers)."""
        return False

    def dense_time(self, layer: int, tokens: int, context: int):
        """Seconds :meth:`dense` would take, or None when the clock cannot say in advance."""
        return None

    def experts_time(self, slots: int, experts: int):
        """Seconds :meth:`experts` would take, or None when the clock cannot say in advance."""
        return None

    def dense(self, layer: int, tokens: int, context: int):
        """Everything the model runs between MoE layer ``layer - 1``'s experts and layer ``layer``'s."""

    def experts(self, slots: int, experts: int, unpacked: int = 0):
        """A layer's routed experts on the device: ``slots`` token-expert pairs over ``experts`` experts, of
        which ``unpacked`` run from a stored low-precision copy (unpacked first)."""

    def tail(self, tokens: int, context: int):
        """Everything after the last MoE layer (trailing dense layers, final norm, LM head)."""
