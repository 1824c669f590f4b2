from dataclasses import dataclass

from ..base import check_choice
from .base import CAPACITY_UNITS, EVICTION, EvictionPolicy
from .structures import KeyLists

T1, T2, B1, B2 = 0, 1, 2, 3  # ARC's lists: KeyLists lists, each LRU first


@dataclass
class ARCParams:
    capacity_unit: str = "fetch"

    def __post_init__(self):
        check_choice("capacity_unit", self.capacity_unit, CAPACITY_UNITS)


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
    prefetch is admitted like a miss. Hit counts equal libCacheSim's ARC on flat traces (tests).

    The four lists are one :class:`~.structures.KeyLists` (O(1) per request); ``t1``, ``t2``, ``b1``, ``b2`` read
    them as lists of keys, LRU first. Compiled, an extension type (``arc.pxd``) whose hooks the cache
    manager calls in C."""

    name = "arc"
    Params = ARCParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self._lists = KeyLists(4)
        self.p = 0.0
        self.c = 1
        self._ghost_hit = False  # the key being admitted was in B1 or B2
        self._in_b2 = False
        self._no_ghost = -1  # victim chosen by case IV(a) with B1 empty: no ghost entry

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.c = self.capacity_experts(self.params.capacity_unit)

    def resized(self, capacity):
        super().resized(capacity)
        self.c = self.capacity_experts(self.params.capacity_unit)
        self.p = min(self.p, float(self.c))  # (ARC's target for T1, 0 <= p <= c)

    @property
    def t1(self) -> list:
        return self._lists.keys(T1)

    @property
    def t2(self) -> list:
        return self._lists.keys(T2)

    @property
    def b1(self) -> list:
        return self._lists.keys(B1)

    @property
    def b2(self) -> list:
        return self._lists.keys(B2)

    def on_admit(self, key):
        lists: KeyLists = self._lists
        self._ghost_hit = self._in_b2 = False
        where = lists.owner(key)
        if where == B1:
            self.p = min(float(self.c), self.p + max(lists.size(B2) / lists.size(B1), 1.0))
            lists.remove(key)
            self._ghost_hit = True
        elif where == B2:
            self.p = max(0.0, self.p - max(lists.size(B1) / lists.size(B2), 1.0))
            lists.remove(key)
            self._ghost_hit = self._in_b2 = True

    def on_insert(self, key: int, prefetch: bool):
        self._lists.push_back(key, T2 if self._ghost_hit else T1)
        self._ghost_hit = self._in_b2 = False

    def on_access(self, key: int):
        self._lists.move_back(key, T2)  # from T1 or T2

    def on_remove(self, key: int):
        if key == self._no_ghost:
            self._no_ghost = -1
            self._lists.remove(key)
        else:  # the key leaves for its list's ghost list
            self._lists.move_back(key, B1 if self._lists.owner(key) == T1 else B2)

    def _replace(self, evictable):
        lists: KeyLists = self._lists
        n1 = lists.size(T1)
        first = T2
        second = T1
        if (n1 and (n1 > self.p or (n1 == self.p and self._in_b2))) or not lists.size(T2):
            first, second = T1, T2
        key = lists.first(first, evictable)
        return key if key is not None else lists.first(second, evictable)

    def victim(self, evictable):
        if self._ghost_hit:
            return self._replace(evictable)
        lists: KeyLists = self._lists
        c = self.c
        if lists.size(T1) + lists.size(B1) + 1 > c:  # case IV(a): L1 = T1 ∪ B1 is full
            if lists.size(B1):
                lists.remove(lists.front(B1))
                return self._replace(evictable)
            key = lists.first(T1, evictable)
            if key is not None:
                self._no_ghost = key
                return key
            return lists.first(T2, evictable)
        if lists.size(T1) + lists.size(T2) + lists.size(B1) + lists.size(B2) >= 2 * c and lists.size(B2):  # IV(b)
            lists.remove(lists.front(B2))
        return self._replace(evictable)


EVICTION.register(ARC)
