# The replay driver's C-level declarations (Cython reads this beside driver.py; plain Python never does):
# its records are extension types allocated and filled in C, and its loop calls the engine in C.

from specmd.engine.engine cimport Engine
from specmd.engine.record cimport GateRecord


cdef class TraceRecord(GateRecord):
    cdef public object trace
    cdef public object rows
    cdef public long k
    cdef public long n
    cdef public object _original
    cdef public object _original_weights
    cdef public object _logits

cdef TraceRecord trace_record(TraceRecord rec, trace, rows, long layer, scoring, requested, signal, long k)
