# Belady as an extension type (Cython reads this beside belady.py; plain Python never does).
from specmd.engine.hooks cimport Evictable
from specmd.policies.eviction.base cimport EvictionPolicy

cdef class Belady(EvictionPolicy):
    cdef public object future
    cdef public long long call
    cdef public dict next
    cdef public list heap
    cdef _touch(self, key)
