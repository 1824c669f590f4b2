import cython

from .base import EVICTION, EvictionPolicy, KeyLists


@cython.cclass
class FIFO(EvictionPolicy):
    """First in, first out: the expert resident longest is evicted; hits do not reorder.
    Within one layer call, insertion is in ascending expert index (lower index leaves first).

    The order is one :class:`~.base.KeyLists` list (O(1) per request, no allocation). Compiled, this class is an
    extension type (``fifo.pxd``) whose hooks the cache manager calls in C."""

    name = "fifo"

    def __cinit__(self, *args, **kwargs):
        # (compiled: runs before any __init__, even one a subclass forgot to chain, so the typed list is
        # never None when a hook runs in C; plain Python never calls it, and __init__ makes the same)
        self._list = KeyLists(1)

    def __init__(self, params=None):
        super().__init__(params)
        self._list = KeyLists(1)

    @cython.ccall
    def on_insert(self, key: cython.longlong, prefetch: cython.bint):
        self._list.push_back(key)

    @cython.ccall
    def on_access(self, key: cython.longlong):
        pass

    @cython.ccall
    def on_remove(self, key: cython.longlong):
        self._list.remove(key)

    @cython.ccall
    def victim(self, evictable):
        return self._list.first(0, evictable)


EVICTION.register("fifo")(FIFO)  # (a statement, not a decorator: Cython takes no decorator on an extension type)
