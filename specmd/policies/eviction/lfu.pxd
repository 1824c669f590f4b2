# LFU as an extension type (Cython reads this beside lfu.py; plain Python never does). LHU derives from it.
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport KeyHeap

cdef class LFU(EvictionPolicy):
    cdef public long long clock
    cdef public bint _requests
    cdef public bint _history
    cdef public KeyHeap _heap
    cdef public long long[:] _count
    cdef public long long[:] _last
    cpdef long long weight(self, long long key)
    cdef _fit(self, long long key)
    cdef _touch(self, long long key, long long weight)
