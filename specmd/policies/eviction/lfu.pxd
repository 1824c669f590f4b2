# LFU as an extension type (Cython reads this beside lfu.py; plain Python never does). LHU derives from it.
from specmd.policies.eviction.base cimport LazyHeap, OrderedEviction

cdef class LFU(OrderedEviction):
    cdef public dict count
    cdef public dict last
    cdef public long long clock
    cdef public bint _requests
    cdef public bint _history
    cdef public LazyHeap _heap
    cdef public dict _entry
    cdef public set _dirty
    cpdef long long weight(self, long long key)
    cdef _touch(self, long long key, long long weight)
