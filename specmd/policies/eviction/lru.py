from collections import OrderedDict

from .base import EVICTION, EvictionPolicy


@EVICTION.register("lru")
class LRU(EvictionPolicy):
    """Least recently used. Inserts (demand fetches and prefetches) and hits count as uses.

    Ties are impossible: uses are totally ordered by the order the cache manager reports them, and the
    manager reports the experts of one layer call in ascending expert index, so among experts touched
    by the same layer call the lower index is the older one and is evicted first.
    """

    def __init__(self, params=None, keys=None):
        super().__init__(params, keys)
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, key, prefetch):
        self._order[key] = None

    def on_access(self, key):
        self._order.move_to_end(key)

    def on_remove(self, key):
        del self._order[key]

    def victim(self, evictable):
        for key in self._order:
            if evictable(key):
                return key
        return None
