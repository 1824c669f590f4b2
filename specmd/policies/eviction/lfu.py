from dataclasses import dataclass

from .base import EVICTION, OrderedEviction, argmin_key


@EVICTION.register("lfu")
class LFU(OrderedEviction):
    """Least frequently used (SpecMD App. B): evicts the resident expert with the fewest accesses over the
    whole run. Counts persist after eviction ("entire inference history"; set ``history: false`` for
    in-cache counts, which is what libCacheSim's LFU does). An insert counts as one access.
    Ties: least recently used first."""

    @dataclass
    class Params:
        history: bool = True

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.clock = 0

    def weight(self, key) -> int:
        """How much one use of ``key`` counts (LHU counts only high-precision uses)."""
        return 1

    def _touch(self, key):
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + self.weight(key)
        self.last[key] = self.clock

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        self._touch(key)

    def on_access(self, key):
        self._touch(key)

    def on_remove(self, key):
        super().on_remove(key)
        if not self.params.history:
            del self.count[key]

    def victim(self, evictable):
        count, last = self.count, self.last
        return argmin_key(self._order, evictable, lambda k: (count[k], last[k]))
