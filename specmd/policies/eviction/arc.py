from dataclasses import dataclass

from ..base import check_choice
from .base import CAPACITY_UNITS, EVICTION, EvictionPolicy


def _first(keys, evictable):
    for key in keys:
        if evictable(key):
            return key
    return None


@EVICTION.register("arc")
class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003). T1 holds keys seen once recently, T2 keys
    seen at least twice; ghost lists B1/B2 remember recent evictions from each; the target size ``p`` of T1
    grows on a B1 ghost hit (by max(|B2|/|B1|, 1)) and shrinks on a B2 ghost hit. ``c`` is the pool's
    capacity in experts; ARC's c is "the cache size in pages" of equal size, and expert copies differ in
    size when a miss policy loads quantized ones, so ``capacity_unit`` names the reading: ``fetch``
    (default: copies at the miss policy's fetch precision, the number of copies the pool actually holds
    under a cascade) or ``native`` (experts at the stored precision). They agree under ``miss=fetch``.

    Mapping onto the cache manager: ``on_admit`` classifies the incoming key (ghost hit: adapt ``p``; else
    the paper's case IV) before room is made; ``victim`` performs the case's ghost bookkeeping and REPLACE
    (LRU of T1 if T1 is non-empty and |T1| > p, or |T1| = p and the key was in B2, or T2 is empty; else
    LRU of T2). Case IV(a) with B1 empty evicts T1's LRU without a ghost. Pinned experts (the running
    layer's, in-flight prefetches) are skipped within the chosen list, falling back to the other list. A
    prefetch is admitted like a miss. Hit counts equal libCacheSim's ARC on flat traces (tests)."""

    @dataclass
    class Params:
        capacity_unit: str = "fetch"

        def __post_init__(self):
            check_choice("capacity_unit", self.capacity_unit, CAPACITY_UNITS)

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.t1: dict[int, None] = {}
        self.t2: dict[int, None] = {}
        self.b1: dict[int, None] = {}
        self.b2: dict[int, None] = {}
        self.p = 0.0
        self.c = 1
        self._ghost_hit = False  # the key being admitted was in B1 or B2
        self._in_b2 = False
        self._no_ghost = None  # victim chosen by case IV(a) with B1 empty: no ghost entry

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.c = self.capacity_experts(self.params.capacity_unit)

    def on_admit(self, key):
        b1, b2 = self.b1, self.b2
        self._ghost_hit = self._in_b2 = False
        if key in b1:
            self.p = min(float(self.c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._ghost_hit = True
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._ghost_hit = self._in_b2 = True

    def on_insert(self, key, prefetch):
        (self.t2 if self._ghost_hit else self.t1)[key] = None
        self._ghost_hit = self._in_b2 = False

    def on_access(self, key):
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def on_remove(self, key):
        if key == self._no_ghost:
            self._no_ghost = None
            del self.t1[key]
        elif key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None

    def _replace(self, evictable):
        n1 = len(self.t1)
        if (n1 and (n1 > self.p or (n1 == self.p and self._in_b2))) or not self.t2:
            first, second = self.t1, self.t2
        else:
            first, second = self.t2, self.t1
        key = _first(first, evictable)
        return key if key is not None else _first(second, evictable)

    def victim(self, evictable):
        if self._ghost_hit:
            return self._replace(evictable)
        t1, t2, b1, b2, c = self.t1, self.t2, self.b1, self.b2, self.c
        if len(t1) + len(b1) + 1 > c:  # case IV(a): L1 = T1 ∪ B1 is full
            if b1:
                del b1[next(iter(b1))]
                return self._replace(evictable)
            key = _first(t1, evictable)
            if key is not None:
                self._no_ghost = key
                return key
            return _first(t2, evictable)
        if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * c and b2:  # case IV(b)
            del b2[next(iter(b2))]
        return self._replace(evictable)
