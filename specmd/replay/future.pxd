# The replay's future as an extension type (Cython reads this beside future.py; plain Python never does):
# Belady asks next_use in C.

cimport cython


cdef class Future:
    cdef public object call_layer
    cdef public object call_ptr
    cdef public object experts
    cdef public long num_experts
    cdef long long[:] _calls
    cdef long long[:] _ptr
    cdef long long[:] _cursor
    @cython.locals(end="long long", i="long long")
    cpdef long long next_use(self, long long key, long long call)
