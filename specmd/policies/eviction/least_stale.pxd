# Least-Stale as an extension type (Cython reads this beside least_stale.py; plain Python never does).
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport LayerQueues

cdef class LeastStale(EvictionPolicy):
    cdef long long[:] _mark
    cdef public long long pass_index
    cdef public long current
    cdef public long long _e
    cdef public bint _flat
    cdef public LayerQueues _queues
    cdef _current(self, long long key)
