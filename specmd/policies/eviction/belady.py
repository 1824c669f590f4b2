import heapq

import cython

from ...errors import ConfigError
from ...engine.hooks import Evictable, as_evictable
from .base import EVICTION, EvictionPolicy


@cython.cclass
class Belady(EvictionPolicy):
    """Belady's MIN (the offline optimum; FlashMoE's training oracle, Cache-Conditional Experts' Fig. 9
    bound): evicts the resident expert whose next request is furthest in the future, at (forward pass,
    MoE layer call) granularity; prefetched copies count like any other (their next use is the request they
    were prefetched for, or later). Experts never requested again go first (ties: lower key).

    It needs the future, so it runs only in trace replay (``replay.trace=PATH``; the model view's
    ``future``); a live run is rejected before the model loads. Next uses come from the router's own
    recorded requests: under cache-aware routing the replayed requests can differ (those replays say
    ``exact: false``) and a key whose recorded next use has passed is re-looked-up when it reaches the
    top. A max-heap on next use with lazy invalidation: O(log N) per insert, hit and eviction. On flat
    traces its hit counts equal libCacheSim's Belady (tests). Compiled, an extension type (``belady.pxd``)
    whose hooks the cache manager calls in C."""

    name = "belady"
    needs_future = True

    def setup(self, model):
        if model.future is None:
            raise ConfigError("eviction=belady needs the future: replay a trace (replay.trace=PATH)")
        self.future = model.future
        self.call = -1
        self.next = {}  # resident key -> its next use (a call index)
        self.heap = []  # (-next use, key), lazily invalidated

    def on_layer(self, layer, record=None):
        if record is not None:
            self.call = record.call

    @cython.cfunc
    def _touch(self, key):
        nu = self.future.next_use(key, self.call)
        self.next[key] = nu
        heapq.heappush(self.heap, (-nu, key))
        if len(self.heap) > 2 * len(self.next) + 64:  # drop superseded entries: memory stays O(resident)
            self.heap = [(-n, k) for k, n in self.next.items()]
            heapq.heapify(self.heap)

    @cython.ccall
    def on_insert(self, key: cython.longlong, prefetch: cython.bint):
        self._touch(key)

    @cython.ccall
    def on_access(self, key: cython.longlong):
        self._touch(key)

    @cython.ccall
    def on_remove(self, key: cython.longlong):
        del self.next[key]

    @cython.ccall
    def victim(self, evictable):
        heap: list = self.heap
        nxt: dict = self.next
        ev: Evictable = as_evictable(evictable)
        skipped = []
        found = None
        while heap:
            neg, key = heap[0]
            if nxt.get(key) != -neg:  # removed, or re-touched since this entry was pushed
                heapq.heappop(heap)
                continue
            if -neg <= self.call:  # its recorded next use has passed without a request (inexact replays)
                heapq.heappop(heap)
                self._touch(key)
                heap = self.heap  # (a touch may rebuild the heap)
                continue
            if ev.ok(key):
                found = key
                break
            skipped.append(heapq.heappop(heap))
        for item in skipped:
            heapq.heappush(heap, item)
        return found


EVICTION.register("belady")(Belady)  # (a statement, not a decorator: Cython takes no decorator on an extension type)
