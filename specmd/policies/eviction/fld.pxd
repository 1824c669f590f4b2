# FLD as an extension type (Cython reads this beside fld.py; plain Python never does).
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport LayerQueues

cdef class FLD(EvictionPolicy):
    cdef public long current
    cdef public long long _e
    cdef public LayerQueues _queues
