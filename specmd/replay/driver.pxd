# The replay driver's C-level declarations (Cython reads this beside driver.py; plain Python never does):
# its records are extension types allocated and filled in C, and its loop calls the engine in C.

cimport cython

from specmd.engine.engine cimport Engine
from specmd.engine.record cimport GateRecord


cdef class TraceRecord(GateRecord):
    cdef public object trace
    cdef public long long r0
    cdef public long k
    cdef public long n
    cdef public object _original
    cdef public object _original_weights
    cdef public object _logits
    cdef public object table


cdef class ProbsTable:
    cdef public object logits
    cdef public object scoring
    cdef public long long chunk
    cdef public long long c0
    cdef public long long c1
    cdef public object probs
    cpdef rows(self, long long r0, long long n)

cdef TraceRecord trace_record(TraceRecord rec, trace, long long r0, long n, long layer, scoring, requested, signal, long k, table)

@cython.locals(eng=Engine, k=long, c=Py_ssize_t, C=Py_ssize_t, rec=TraceRecord, calls="long long[:, :]",
               offsets="long long[:]", requested=list, layer=long, r0="long long", n="long long")
cpdef run_replay(trace, spec, engine=*, ptr=*, experts=*)
