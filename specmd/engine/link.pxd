# The link's C-level declarations (Cython reads this beside link.py; plain Python never does): the simulated
# clock cimports them so its calls into the channel are C calls.

cimport cython


cdef class Transfer:
    cdef public object nbytes
    cdef public double issued_at
    cdef public double ready_at
    cdef public bint started

cdef Transfer _fill(Transfer tr, object nbytes, double issued_at)
cdef Transfer _new_transfer(object nbytes, double issued_at)

cdef class TransferChannel:
    cdef public double bw
    cdef public double latency
    cdef public double free_at
    cdef public double busy_s
    cdef public object queue
    cdef public object last
    cpdef double duration(self, double nbytes)
    cpdef Transfer handle(self, nbytes, double issued_at)
    @cython.locals(d=double)
    cpdef _start(self, Transfer tr, double at)
    @cython.locals(start=double, head=Transfer)
    cpdef advance(self, double t)
    @cython.locals(start=double, d=double)
    cpdef double demand(self, double t, double nbytes)
    @cython.locals(start=double)
    cpdef double promote(self, Transfer tr, double t)
