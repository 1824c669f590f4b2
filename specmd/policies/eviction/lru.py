from .base import EVICTION
from .fifo import FIFO


class LRU(FIFO):
    """Least recently used. Inserts (demand fetches and prefetches) and hits count as uses.

    Ties are impossible: uses are totally ordered by the order the cache manager reports them, and the
    manager reports the experts of one layer call in ascending expert index, so among experts touched
    by the same layer call the lower index is the older one and is evicted first.

    FIFO's list, with a use moving its key to the back. Compiled, an extension type (``lru.pxd``).
    """

    name = "lru"

    def on_access(self, key: int):
        self._list.move_back(key)


EVICTION.register(LRU)
