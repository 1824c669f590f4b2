# Belady as an extension type (Cython reads this beside belady.py; plain Python never does).

cimport cython
from specmd.engine.hooks cimport Evictable
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport KeyHeap
from specmd.replay.future cimport Future

cdef class Belady(EvictionPolicy):
    cdef public Future future
    cdef public long long call
    cdef public KeyHeap _heap
    cdef _touch(self, long long key)
    @cython.locals(heap=KeyHeap, ev=Evictable, key="long long")
    cpdef victim(self, evictable)
