# ARC as an extension type (Cython reads this beside arc.py; plain Python never does).

cimport cython
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport KeyLists

cdef class ARC(EvictionPolicy):
    cdef public KeyLists _lists
    cdef public double p
    cdef public long long c
    cdef public bint _ghost_hit
    cdef public bint _in_b2
    cdef public long long _no_ghost
    @cython.locals(lists=KeyLists, n1="long long", first=long, second=long)
    cpdef _replace(self, evictable)
    @cython.locals(lists=KeyLists, c="long long")
    cpdef victim(self, evictable)
