import heapq

from ...errors import ConfigError
from .base import EVICTION, EvictionPolicy


@EVICTION.register("belady")
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
    traces its hit counts equal libCacheSim's Belady (tests)."""

    needs_future = True

    def setup(self, model):
        if model.future is None:
            raise ConfigError("eviction=belady needs the future: replay a trace (replay.trace=PATH)")
        self.future = model.future
        self.call = -1
        self.next: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []

    def on_layer(self, layer, record=None):
        if record is not None:
            self.call = record.call

    def _touch(self, key):
        nu = self.future.next_use(key, self.call)
        self.next[key] = nu
        heap = self.heap
        heapq.heappush(heap, (-nu, key))
        if len(heap) > 2 * len(self.next) + 64:  # drop superseded entries: memory stays O(resident)
            self.heap = heap = [(-n, k) for k, n in self.next.items()]
            heapq.heapify(heap)

    def on_insert(self, key, prefetch):
        self._touch(key)

    def on_access(self, key):
        self._touch(key)

    def on_remove(self, key):
        del self.next[key]

    def victim(self, evictable):
        heap, nxt = self.heap, self.next
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
                continue
            if evictable(key):
                found = key
                break
            skipped.append(heapq.heappop(heap))
        for item in skipped:
            heapq.heappush(heap, item)
        return found
