# LeCaR as an extension type (Cython reads this beside lecar.py; plain Python never does).

cimport cython
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport KeyHeap, KeyLists

cdef class LeCaR(EvictionPolicy):
    cdef public double w_lru
    cdef public object rng
    cdef public KeyLists _recency
    cdef public dict hist_lru
    cdef public dict hist_lfu
    cdef public long long time
    cdef public long long c
    cdef public double discount
    cdef public long _pending
    cdef public KeyHeap _lfu
    @cython.locals(use_lru=bint)
    cpdef victim(self, evictable)
