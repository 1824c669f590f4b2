# The eviction bases' C-level declarations (Cython reads this beside base.py; plain Python never does): a
# built-in policy compiled as an extension type cimports its base from here (its own .pxd, e.g. lru.pxd).

from specmd.engine.hooks cimport EvictionHooks


cdef class EvictionPolicy(EvictionHooks):
    pass


cdef class OrderedEviction(EvictionPolicy):
    cdef public dict _order


cdef class KeyList:
    cdef long long[:] _next
    cdef long long[:] _prev
    cdef public long long front
    cdef public long long back
    cdef public long long size
    cpdef push_back(self, long long key)
    cpdef remove(self, long long key)
    cpdef move_back(self, long long key)
    cpdef first(self, evictable)
