# FIFO as an extension type (Cython reads this beside fifo.py; plain Python never does). LRU derives from it.
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport KeyLists

cdef class FIFO(EvictionPolicy):
    cdef public KeyLists _list
