# The layer call's C-level declarations (Cython reads this beside call.py; plain Python never does). The cache
# manager cimports LayerCall so its calls into the call are C calls.

cimport cython

from specmd.engine.residency cimport Pool, Residency


cdef class LayerCall:
    cdef public Residency _m
    cdef public long layer
    cdef public long long base
    cdef public Pool pool
    cdef public object record
    cdef public list waits
    cdef public object execution
    cdef public long long host_slots
    cdef public long long host_experts
    cdef public object host_handle
    cdef public long long demanded
    cdef public object fetch_precision
    cdef public object index
    cdef public object weights
    cdef public long n
    cpdef reset(self, long layer, long long base, Pool pool, record, index, weights, long n)
    cpdef fetch_many(self, experts, precision)
