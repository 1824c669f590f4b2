from .base import EVICTION, OrderedEviction


@EVICTION.register("lru")
class LRU(OrderedEviction):
    """Least recently used. Inserts (demand fetches and prefetches) and hits count as uses.

    Ties are impossible: uses are totally ordered by the order the cache manager reports them, and the
    manager reports the experts of one layer call in ascending expert index, so among experts touched
    by the same layer call the lower index is the older one and is evicted first.
    """

    def on_access(self, key):
        order = self._order
        del order[key]
        order[key] = None
