# ARC as an extension type (Cython reads this beside arc.py; plain Python never does).
from specmd.policies.eviction.base cimport EvictionPolicy, KeyLists

cdef class ARC(EvictionPolicy):
    cdef public KeyLists _lists
    cdef public double p
    cdef public long long c
    cdef public bint _ghost_hit
    cdef public bint _in_b2
    cdef public long long _no_ghost
    cpdef _replace(self, evictable)
