from .base import EVICTION, EvictionPolicy


def _first(keys, evictable):
    for key in keys:
        if evictable(key):
            return key
    return None


@EVICTION.register("arc")
class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003). T1 holds keys seen once recently, T2 keys
    seen at least twice; ghost lists B1/B2 remember recent evictions from each; the target size ``p`` of T1
    grows on a B1 ghost hit and shrinks on a B2 ghost hit. ``c`` is the pool's capacity in experts at the
    model's stored precision.

    Mapping onto the cache manager: the ghost-hit adaptation happens in ``on_admit`` (before room is made,
    as in ARC's REPLACE); ``victim`` is REPLACE (LRU of T1 if |T1| > p, or |T1| = p and the key being
    admitted was in B2, else LRU of T2), falling back to the other list when pinned experts make the chosen
    list unevictable; ghost lists are trimmed to |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c. A prefetch is
    admitted like a miss. Hit counts equal libCacheSim's ARC on flat traces (tests/test_eviction.py)."""

    def __init__(self, params=None, keys=None):
        super().__init__(params, keys)
        self.t1: dict[int, None] = {}
        self.t2: dict[int, None] = {}
        self.b1: dict[int, None] = {}
        self.b2: dict[int, None] = {}
        self.p = 0.0
        self.c = 0
        self._admit_to_t2 = False
        self._admit_in_b2 = False

    def attach(self, cache, pool):
        super().attach(cache, pool)
        self.c = self.capacity_experts()

    def on_admit(self, key):
        b1, b2 = self.b1, self.b2
        self._admit_to_t2 = False
        self._admit_in_b2 = False
        if key in b1:
            self.p = min(float(self.c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._admit_to_t2 = True
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._admit_to_t2 = True
            self._admit_in_b2 = True

    def on_insert(self, key, prefetch):
        (self.t2 if self._admit_to_t2 else self.t1)[key] = None
        self._admit_to_t2 = self._admit_in_b2 = False
        self._trim()

    def on_access(self, key):
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def on_remove(self, key):
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        self._trim()

    def _trim(self):
        c, t1, t2, b1, b2 = self.c, self.t1, self.t2, self.b1, self.b2
        while b1 and len(t1) + len(b1) > c:
            del b1[next(iter(b1))]
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            del b2[next(iter(b2))]

    def victim(self, evictable):
        n1 = len(self.t1)
        if n1 and (n1 > self.p or (self._admit_in_b2 and n1 == int(self.p))):
            first, second = self.t1, self.t2
        else:
            first, second = self.t2, self.t1
        key = _first(first, evictable)
        return key if key is not None else _first(second, evictable)
