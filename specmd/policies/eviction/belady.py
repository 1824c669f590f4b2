from ...errors import ConfigError
from ...engine.hooks import Evictable, as_evictable
from .base import EVICTION, EvictionPolicy
from .structures import KeyHeap


class Belady(EvictionPolicy):
    """Belady's MIN (the offline optimum; FlashMoE's training oracle, Cache-Conditional Experts' Fig. 9
    bound): evicts the resident expert whose next request is furthest in the future, at (forward pass,
    MoE layer call) granularity; prefetched copies count like any other (their next use is the request they
    were prefetched for, or later). Experts never requested again go first (ties: lower key).

    It needs the future, so it runs only in trace replay (``replay.trace=PATH``; the model view's
    ``future``); a live run is rejected before the model loads. Next uses come from the router's own
    recorded requests: under cache-aware routing the replayed requests can differ (those replays say
    ``exact: false``) and a key whose recorded next use has passed is re-looked-up when it reaches the
    top. The residents are ranked by ``(-next use, key)`` in a :class:`~.structures.KeyHeap` (the replay's future
    answers next uses in C): O(log N) per insert, hit and eviction, no allocation. On flat
    traces its hit counts equal libCacheSim's Belady (tests). Compiled, an extension type (``belady.pxd``)
    whose hooks the cache manager calls in C."""

    name = "belady"
    needs_future = True

    def setup(self, model):
        if model.future is None:
            raise ConfigError("eviction=belady needs the future: replay a trace (replay.trace=PATH)")
        self.future = model.future
        self.call = -1
        self._heap = KeyHeap()  # resident keys by (-next use, key): the furthest next use first

    @property
    def next(self) -> dict:
        """Each resident key's next use (a call index; a new dict: for checks and tests)."""
        return {k: -self._heap.rank(k) for k in self._heap.keys()}

    def on_layer(self, layer, record=None):
        if record is not None:
            self.call = record.call

    def _touch(self, key: int):
        self._heap.set(key, -self.future.next_use(key, self.call), 0)

    def on_insert(self, key: int, prefetch: bool):
        self._touch(key)

    def on_access(self, key: int):
        self._touch(key)

    def on_remove(self, key: int):
        self._heap.remove(key)

    def victim(self, evictable):
        heap: KeyHeap = self._heap
        ev: Evictable = as_evictable(evictable)
        skipped = None  # keys ranked first but not evictable: set aside, then put back with their ranks
        found = None
        while True:
            key = heap.top()
            if key < 0:
                break
            if -heap.rank(key) <= self.call:  # its recorded next use has passed without a request (inexact replays)
                self._touch(key)
                continue
            if ev.ok(key):
                found = key
                break
            if skipped is None:
                skipped = []
            skipped.append(key)
            heap.discard(key)
        if skipped is not None:
            for k in skipped:
                heap.set(k, heap.rank(k), 0)
        return found


EVICTION.register(Belady)
