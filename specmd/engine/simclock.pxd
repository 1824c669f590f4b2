# The simulated clock's C-level declarations (Cython reads this beside simclock.py; plain Python never does).
# A field or hot method added to simclock.py is declared here.

cimport cython

from specmd.engine.clock cimport Clock
from specmd.engine.link cimport Transfer, TransferChannel


cdef inline double _roof(double a, double b, double serial)
cdef inline double _memory(double nbytes, double gemv_bytes, double mem, double gemv)
@cython.locals(s=double)
cpdef double one_row(double slots, double experts)

cdef class SimClock(Clock):
    cdef public object geom
    cdef public TransferChannel channel
    cdef public object roofline
    cdef public object host_roofline
    cdef public double layer_overhead
    cdef public double token_overhead
    cdef public double expert_overhead
    cdef public double issue_overhead
    cdef public double predict_overhead
    cdef public double unpack_overhead
    cdef public double layer_token_overhead
    cdef public double place_overhead
    cdef public long long placed
    cdef public double decision_overhead
    cdef public double host_call_overhead
    cdef public double host_expert_overhead
    cdef public double host_token_overhead
    cdef public bint overlap
    cdef public double contention
    cdef public double host_free_at
    cdef public double host_busy_s
    cdef double _host_acc
    cdef double _dev_acc
    cdef public long long issued
    cdef bint _demand_job
    cdef public long long predictions
    cdef public double now
    cdef public double stall_s
    cdef double _demand_ready
    cdef double _peak
    cdef double _mem
    cdef double _serial
    cdef double _gemv
    cdef double _expert_params
    cdef double _expert_bytes
    cdef double _hidden
    cdef double _dtype_bytes
    cdef double[:] _dense_params
    cdef double[:] _attn_layers
    cdef double _tail_params
    cdef double _tail_attn_layers
    @cython.locals(dt=double)
    cpdef double wait_until(self, double t)
    cpdef sync(self)
    @cython.locals(ready=double)
    cpdef demand(self, long long nbytes, long long placed=*)
    @cython.locals(h=Transfer)
    cpdef done(self, handle)
    @cython.locals(t=double, h=Transfer)
    cpdef double wait(self, handles)
    @cython.locals(d=double, tr=Transfer, start=double, end=double, k=double)
    cpdef host(self, slots, experts)
    @cython.locals(link_end=double, ov=double, extra=double, last=Transfer, ch=TransferChannel)
    cdef double _contend(self, double start, double end)
    cdef void _compute(self, double d, double k)
    @cython.locals(p=double, a=double)
    cpdef dense(self, long layer, long long tokens, long long context)
    @cython.locals(d=double)
    cpdef experts(self, long long slots, long long experts, long long unpacked=*)
    @cython.locals(d=double)
    cpdef tail(self, long long tokens, long long context)
    @cython.locals(flops=double, nbytes=double)
    cdef double _dense_device(self, double params, double attn_layers, double tokens, double context)
    cdef double _dense_time(self, double params, double attn_layers, double tokens, double context)
    cdef double _experts_kernel(self, double s, double n)
    cdef double _host_kernel(self, double slots, double experts)
    cdef double _experts_time(self, double s, double n)
