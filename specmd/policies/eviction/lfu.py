from dataclasses import dataclass

from .base import EVICTION, LazyHeap, OrderedEviction


@EVICTION.register("lfu")
class LFU(OrderedEviction):
    """Least frequently used (SpecMD App. B): evicts the resident expert with the fewest accesses over the
    whole run. Counts persist after eviction ("entire inference history"; set ``history: false`` for
    in-cache counts, which is what libCacheSim's LFU does). An insert counts as one access.
    Ties: least recently used first.

    The ranking lives in a min-heap of ``(count, last, key)`` with lazy invalidation
    (:class:`~.base.LazyHeap`; an entry is live while it is its resident key's newest one, ``_entry[key]``);
    keys touched since the last victim are pushed once, when the next victim is asked for."""

    @dataclass
    class Params:
        history: bool = True

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.clock = 0
        self._heap = LazyHeap()
        self._entry: dict[int, tuple[int, int, int]] = {}  # resident key -> its live heap entry
        self._dirty: set[int] = set()  # keys touched since their newest heap entry was pushed

    def weight(self, key) -> int:
        """How much one use of ``key`` counts (LHU counts only high-precision uses)."""
        return 1

    def _touch(self, key):
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + self.weight(key)
        self.last[key] = self.clock
        self._dirty.add(key)

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        self._touch(key)

    def on_access(self, key):
        self._touch(key)

    def on_remove(self, key):
        super().on_remove(key)
        self._entry.pop(key, None)
        if not self.params.history:
            del self.count[key]

    def victim(self, evictable):
        count, last, order, heap, entry = self.count, self.last, self._order, self._heap, self._entry
        dirty = self._dirty
        if len(heap) + len(dirty) > 2 * len(order) + 64:  # mostly dead entries: rebuild from the residents
            entry.clear()
            for k in order:
                entry[k] = (count[k], last[k], k)
            heap = self._heap = LazyHeap(entry.values())
        else:
            for k in dirty:
                if k in order:
                    ent = entry[k] = (count[k], last[k], k)
                    heap.push(ent)
        dirty.clear()
        ent = heap.first(evictable, entry)
        return None if ent is None else ent[2]
