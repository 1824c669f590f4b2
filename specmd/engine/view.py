"""Read-only views that policies see instead of the engine's objects.

:class:`CacheView` answers what a policy may ask about the cache: which experts of a layer are present
(arrived or in flight) or resident (arrived), the precision / bytes / in-flight state of an entry, the
geometry; its ``clock`` (:class:`ClockView`) answers what things cost and when the link and the host are free.
Neither has a method that changes anything.
"""

from __future__ import annotations

from typing import Optional

from .geometry import Geometry


class CacheView:
    __slots__ = ("_m", "clock")

    def __init__(self, manager):
        self._m = manager
        self.clock = ClockView(manager)  # what things cost and when the link and the host are free

    # -- the forward pass -------------------------------------------------------------------------
    @property
    def pass_kind(self) -> Optional[str]:
        """The ongoing forward pass's kind, ``"prefill"`` or ``"decode"`` (None outside a pass)."""
        cur = self._m.current_pass
        return None if cur is None else cur[0]

    # -- geometry and precisions ------------------------------------------------------------------
    @property
    def geometry(self) -> Geometry:
        return self._m.geom

    @property
    def fetch_precision(self) -> str:
        """The precision plain fetches and prefetches use (the miss policy's)."""
        return self._m.fetch_precision

    def bytes_of(self, precision: str) -> int:
        return self._m.precisions.bytes_of[precision]

    def bits_of(self, precision: str) -> int:
        return self._m.precisions.bits_of[precision]

    @property
    def precisions(self) -> list[str]:
        return list(self._m.precisions.bytes_of)

    # -- contents ---------------------------------------------------------------------------------
    def present(self, layer: int) -> list[int]:
        """Experts of ``layer`` in the cache, arrived or still in flight (what cache-aware routing sees)."""
        m = self._m
        E = m.geom.num_experts
        base = layer * E
        has = m.has
        return [e for e in range(E) if has(base + e)]

    def resident(self, layer: int) -> list[int]:
        """Experts of ``layer`` whose bytes are on the device now."""
        m = self._m
        E = m.geom.num_experts
        base = layer * E
        done = m.clock.done
        has, transfer_of = m.has, m.transfer_of
        out = []
        for e in range(E):
            if has(base + e):
                tr = transfer_of(base + e)
                if tr is None or done(tr):
                    out.append(e)
        return out

    def __contains__(self, key: int) -> bool:
        return self._m.has(key)

    def precision(self, key: int) -> Optional[str]:
        return self._m.precision_of(key)

    def bits(self, key: int) -> Optional[int]:
        prec = self._m.precision_of(key)
        return None if prec is None else self._m.precisions.bits_of[prec]

    def nbytes(self, key: int) -> Optional[int]:
        ent = self._m.entry(key)
        return None if ent is None else ent.nbytes

    def in_flight(self, key: int) -> bool:
        tr = self._m.transfer_of(key)
        return tr is not None and not self._m.clock.done(tr)


class ClockView:
    """What a policy may ask the clock (``cache.clock`` of the :class:`CacheView` it is given): what a transfer,
    the host's and the device's compute cost, and when the link and the host are free. The costs are the
    clock's own (:mod:`specmd.engine.clock`), so a policy that weighs them (``miss=hybrid``) decides with the
    numbers the run is timed by. It has no method that changes anything."""

    __slots__ = ("_m",)

    def __init__(self, manager):
        self._m = manager

    def transfer_time(self, precision: Optional[str] = None) -> float:
        """Seconds one expert at ``precision`` (default: the fetch precision) takes on the link."""
        return self._m.clock.transfer_time(self._m.precisions.bytes_of[precision or self._m.fetch_precision])

    def host_time(self, slots: int, experts: int) -> float:
        """Seconds the host needs for ``slots`` token-expert pairs over ``experts`` experts (full precision)."""
        return self._m.clock.host_time(slots, experts)

    def device_time(self, slots: int, experts: int) -> float:
        """Seconds the device's compute of ``experts`` experts over ``slots`` token-expert pairs takes (0 when the
        clock cannot say in advance)."""
        t = self._m.clock.experts_time(slots, experts)
        return 0.0 if t is None else t

    def host_beside_device(self) -> bool:
        """Whether host work runs beside the device's compute (a GPU's host) or before it on the same cores."""
        return bool(self._m.clock.host_beside_device())

    def link_backlog(self) -> float:
        """Seconds from now until the link could start a demand fetch (the transfer on it finishes)."""
        return self._m.clock.link_backlog()

    def host_backlog(self) -> float:
        """Seconds from now until the host could start new work (its queued work finishes)."""
        return self._m.clock.host_backlog()
