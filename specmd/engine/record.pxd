# The gate record's C-level declarations (Cython reads this beside record.py; plain Python never does): the
# engine reads a record's fields in C, and the replay driver allocates and fills its records in C.

cdef class GateRecord:
    cdef public long layer
    cdef public long long call
    cdef public object scoring
    cdef public object void
    cdef public long long _slots
    cdef public object _index
    cdef public object _weights
    cdef public object _probs
    cdef public object _scores
    cdef public object _requested
    cdef public object _signal
    cpdef requested(self, long num_experts)

cpdef GateRecord fill(GateRecord rec, long layer, scoring, signal, requested)
