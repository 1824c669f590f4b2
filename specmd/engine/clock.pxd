# The clock's C-level declarations (Cython reads this beside clock.py; plain Python never does). Other
# compiled engine modules cimport this type so their calls into the clock are C calls, not Python calls.
# A hot method added to the interface is declared here; native.py runs every module that cimports this
# one as source whenever clock.py runs as source.

cimport cython


cdef class Clock:
    cpdef begin_layer(self)
    cpdef demand(self, long long nbytes, long long placed=*)
    cpdef prefetch(self, long long nbytes, long long placed=*)
    cpdef promote(self, handle)
    cpdef done(self, handle)
    cpdef double wait(self, handles)
    cpdef predicted(self)
    cpdef host(self, slots, experts)
    cpdef bint host_beside_device(self)
    cpdef dense(self, long layer, long long tokens, long long context)
    cpdef experts(self, long long slots, long long experts, long long unpacked=*)
    cpdef mark(self)
    cpdef since(self, mark)
    cpdef tail(self, long long tokens, long long context)
