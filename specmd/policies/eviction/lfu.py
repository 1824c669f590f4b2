from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION, LazyHeap, OrderedEviction

COUNTS = ("requests", "inserts")


@EVICTION.register("lfu")
class LFU(OrderedEviction):
    """Least frequently used (SpecMD App. B): "evicts the expert with the lowest access count over the
    entire inference history". Ties: least recently counted first. Two choices the text leaves open:

    * what an *access* is (``counts``):
      - ``requests`` (default, the paper's "access count"): every time the model requests the expert --
        a hit, a late prefetch, or a miss whatever becomes of it (inserted, streamed because the layer's own
        working set fills the pool, dropped, substituted, computed on the host). A prefetch is not an
        access; the prefetched expert counts when the model requests it.
      - ``inserts``: every insert (demand fetch or prefetch) and every hit; a streamed or otherwise
        unserved miss does not count (specmd before this reading was named).
    * whether counts survive eviction (``history``): ``true`` (default, "entire inference history");
      ``false`` keeps in-cache counts only, restarting at 1 when the expert is inserted by a miss (0 by a
      prefetch), which is libCacheSim's LFU (equal hit counts on flat traces: tests).

    The ranking lives in a min-heap of ``(count, last, key)`` with lazy invalidation
    (:class:`~.base.LazyHeap`; an entry is live while it is its resident key's newest one, ``_entry[key]``);
    keys touched since the last victim are pushed once, when the next victim is asked for."""

    @dataclass
    class Params:
        history: bool = True
        counts: str = "requests"

        def __post_init__(self):
            check_choice("counts", self.counts, COUNTS)

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.clock = 0
        self._requests = self.params.counts == "requests"
        self._heap = LazyHeap()
        self._entry: dict[int, tuple[int, int, int]] = {}  # resident key -> its live heap entry
        self._dirty: set[int] = set()  # keys touched since their newest heap entry was pushed

    def weight(self, key) -> int:
        """How much one use of ``key`` counts (LHU counts only high-precision uses)."""
        return 1

    def _touch(self, key, weight):
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + weight
        self.last[key] = self.clock
        self._dirty.add(key)

    def miss_hook(self):
        return self.on_miss if self._requests else None

    def on_miss(self, key):
        self._touch(key, self.weight(key))

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        if not self._requests:
            self._touch(key, self.weight(key))
            return
        if not self.params.history:  # in-cache counts restart: 1 for the miss that inserted it, 0 for a prefetch
            self.count[key] = 0 if prefetch else self.weight(key)
        self.count.setdefault(key, 0)  # a prefetch of an expert never requested: count 0, least recent
        self.last.setdefault(key, 0)
        self._dirty.add(key)

    def on_access(self, key):
        self._touch(key, self.weight(key))

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
