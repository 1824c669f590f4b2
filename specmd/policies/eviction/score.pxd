# Score-based eviction as an extension type (Cython reads this beside score.py; plain Python never does).

cimport cython
from specmd.policies.eviction.base cimport EvictionPolicy
from specmd.policies.eviction.structures cimport KeyHeap

cdef class ScoreEviction(EvictionPolicy):
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
    @cython.locals(E=Py_ssize_t, n=Py_ssize_t)
    cdef _step(self, long layer, float[:, :] steps)
    @cython.locals(n=Py_ssize_t, T=Py_ssize_t, win="double[:, :, ::1]", t=Py_ssize_t, e=Py_ssize_t, slot=Py_ssize_t)
    cdef _fill(self, long layer, float[:, :] steps)
    @cython.locals(n=Py_ssize_t, E=Py_ssize_t, k=Py_ssize_t, slot=Py_ssize_t, win="double[:, :, ::1]", mean="double[:, ::1]", e=Py_ssize_t, j=Py_ssize_t, base="long long", heap=KeyHeap)
    cdef _rerank(self, long layer)
    @cython.locals(layer="long long", s=double)
    cpdef on_insert(self, long long key, bint prefetch)
