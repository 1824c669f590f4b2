from dataclasses import dataclass

import cython

from ..base import check_choice
from .base import EVICTION, LazyHeap, OrderedEviction

COUNTS = ("requests", "inserts")


@dataclass
class LFUParams:
    history: bool = True
    counts: str = "requests"

    def __post_init__(self):
        check_choice("counts", self.counts, COUNTS)


@cython.cclass
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

    name = "lfu"
    Params = LFUParams  # (module-level: an extension type's body holds no class statement)

    def __cinit__(self, *args, **kwargs):
        # (compiled: runs before any __init__, even one a subclass forgot to chain, so the typed heap is
        # never None when a hook runs in C; plain Python never calls it, and __init__ makes the same)
        self._heap = LazyHeap()

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self.count = {}  # key -> its count (int)
        self.last = {}  # key -> the clock of its last count
        self.clock = 0
        self._requests = self.params.counts == "requests"
        self._history = self.params.history
        self._heap = LazyHeap()
        self._entry = {}  # resident key -> its live heap entry (count, last, key)
        self._dirty = set()  # keys touched since their newest heap entry was pushed

    @cython.ccall
    def weight(self, key: cython.longlong) -> cython.longlong:
        """How much one use of ``key`` counts (LHU counts only high-precision uses)."""
        return 1

    @cython.cfunc
    def _touch(self, key: cython.longlong, weight: cython.longlong):
        self.clock += 1
        self.count[key] = self.count.get(key, 0) + weight
        self.last[key] = self.clock
        self._dirty.add(key)

    def miss_hook(self):
        return self.on_miss if self._requests else None

    def on_miss(self, key):
        self._touch(key, self.weight(key))

    @cython.ccall
    def on_insert(self, key: cython.longlong, prefetch: cython.bint):
        OrderedEviction.on_insert(self, key, prefetch)
        if not self._requests:
            self._touch(key, self.weight(key))
            return
        if not self._history:  # in-cache counts restart: 1 for the miss that inserted it, 0 for a prefetch
            self.count[key] = 0 if prefetch else self.weight(key)
        self.count.setdefault(key, 0)  # a prefetch of an expert never requested: count 0, least recent
        self.last.setdefault(key, 0)
        self._dirty.add(key)

    @cython.ccall
    def on_access(self, key: cython.longlong):
        self._touch(key, self.weight(key))

    @cython.ccall
    def on_remove(self, key: cython.longlong):
        OrderedEviction.on_remove(self, key)
        self._entry.pop(key, None)
        if not self._history:
            del self.count[key]

    @cython.ccall
    def victim(self, evictable):
        count: dict = self.count
        last: dict = self.last
        order: dict = self._order
        heap: LazyHeap = self._heap
        entry: dict = self._entry
        dirty: set = self._dirty
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


EVICTION.register("lfu")(LFU)  # (a statement, not a decorator: Cython takes no decorator on an extension type)
