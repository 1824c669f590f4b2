from array import array
from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION, EvictionPolicy
from .structures import KeyHeap

COUNTS = ("requests", "inserts")


@dataclass
class LFUParams:
    history: bool = True
    counts: str = "requests"

    def __post_init__(self):
        check_choice("counts", self.counts, COUNTS)


class LFU(EvictionPolicy):
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

    Counts and last uses are per-key arrays; the residents are ranked by ``(count, last, key)`` in a
    :class:`~.structures.KeyHeap`, re-ranked in place at every count: O(log N) per request and per victim, no
    allocation (libCacheSim's LFU keeps frequency buckets; its answers are the same)."""

    name = "lfu"
    Params = LFUParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self.clock = 0
        self._requests = self.params.counts == "requests"
        self._history = self.params.history
        self._heap = KeyHeap()  # the resident keys by (count, last, key)
        self._count = array("q", [0])  # per key: its count (0: never counted, or reset by an eviction)
        self._last = array("q", [0])  # per key: the clock of its last count (0: never counted)

    @property
    def count(self) -> dict:
        """Each key's count: the keys resident, or counted and still remembered (``history``; without it an
        evicted key's count is forgotten). A new dict: for checks and tests."""
        return {k: self._count[k] for k in range(len(self._count))
                if self._heap.contains(k) or (self._last[k] and (self._history or self._count[k]))}

    @property
    def last(self) -> dict:
        """Each counted key's last count on the policy's clock (a new dict: for checks and tests)."""
        return {k: self._last[k] for k in range(len(self._last)) if self._last[k]}

    def weight(self, key: int) -> int:
        """How much one use of ``key`` counts (LHU counts only high-precision uses)."""
        return 1

    def _fit(self, key: int):
        """The per-key arrays hold ``key`` (they grow by doubling)."""
        if key < 0:
            raise IndexError(f"key {key} < 0")
        n = len(self._count)
        if key >= n:
            n = max(key + 1, 2 * n)
            count, last = array("q", [0]) * n, array("q", [0]) * n
            for i in range(len(self._count)):
                count[i], last[i] = self._count[i], self._last[i]
            self._count, self._last = count, last

    def _touch(self, key: int, weight: int):
        self._fit(key)
        self.clock += 1
        self._count[key] += weight
        self._last[key] = self.clock
        if self._heap.contains(key):
            self._heap.set(key, self._count[key], self.clock)

    def miss_hook(self):
        return self.on_miss if self._requests else None

    def on_miss(self, key):
        self._touch(key, self.weight(key))

    def on_insert(self, key: int, prefetch: bool):
        self._fit(key)
        if not self._requests:
            self._heap.set(key, self._count[key], self._last[key])
            self._touch(key, self.weight(key))
            return
        if not self._history:  # in-cache counts restart: 1 for the miss that inserted it, 0 for a prefetch
            self._count[key] = 0 if prefetch else self.weight(key)
        # (a prefetch of an expert never requested: count 0, least recent)
        self._heap.set(key, self._count[key], self._last[key])

    def on_access(self, key: int):
        self._touch(key, self.weight(key))

    def on_remove(self, key: int):
        self._heap.remove(key)
        if not self._history:
            self._count[key] = 0

    def victim(self, evictable):
        return self._heap.first(evictable)


EVICTION.register(LFU)
