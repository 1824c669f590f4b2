# LeCaR as an extension type (Cython reads this beside lecar.py; plain Python never does).
from specmd.policies.eviction.base cimport EvictionPolicy, KeyLists, LazyHeap

cdef class LeCaR(EvictionPolicy):
    cdef public double w_lru
    cdef public object rng
    cdef public KeyLists _recency
    cdef public dict freq
    cdef public dict last
    cdef public dict hist_lru
    cdef public dict hist_lfu
    cdef public long long time
    cdef public long long c
    cdef public double discount
    cdef public long _pending
    cdef public LazyHeap _lfu
    cdef public dict _entry
    cdef _rank(self, key)
