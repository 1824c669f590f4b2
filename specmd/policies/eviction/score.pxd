# Score-based eviction as an extension type (Cython reads this beside score.py; plain Python never does).
from specmd.policies.eviction.base cimport EvictionPolicy, KeyHeap

cdef class Score(EvictionPolicy):
    cdef public long n
    cdef public long E
    cdef public bint _token
    cdef public bint _probs
    cdef public bint _zero
    cdef public KeyHeap _heap
    cdef public double[:, :, ::1] _win
    cdef public double[:, ::1] _mean
    cdef public long long[:] _len
    cdef public long long[:] _next
    cdef _step(self, long layer, float[:, :] steps)
    cdef _fill(self, long layer, float[:, :] steps)
    cdef _rerank(self, long layer)
