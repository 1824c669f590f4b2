from .base import EVICTION, EvictionPolicy
from .structures import KeyLists


class FIFO(EvictionPolicy):
    """First in, first out: the expert resident longest is evicted; hits do not reorder.
    Within one layer call, insertion is in ascending expert index (lower index leaves first).

    The order is one :class:`~.structures.KeyLists` list (O(1) per request, no allocation). Compiled, this class is an
    extension type (``fifo.pxd``) whose hooks the cache manager calls in C."""

    name = "fifo"

    def __init__(self, params=None):
        super().__init__(params)
        self._list = KeyLists(1)

    def on_insert(self, key: int, prefetch: bool):
        self._list.push_back(key)

    def on_access(self, key: int):
        pass

    def on_remove(self, key: int):
        self._list.remove(key)

    def victim(self, evictable):
        return self._list.first(0, evictable)


EVICTION.register(FIFO)
