# The clock's C-level declarations (Cython reads this beside clock.py; plain Python never does). Other
# compiled engine modules cimport these types so their calls into the clock are C calls, not Python calls.
# A field or hot method added to clock.py is declared here; native.py runs every module that cimports this
# one as source whenever clock.py runs as source.

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
    @cython.locals(d=double)
    cpdef _start(self, Transfer tr, double at)
    @cython.locals(start=double, head=Transfer)
    cpdef advance(self, double t)
    @cython.locals(start=double, d=double)
    cpdef double demand(self, double t, double nbytes)
    @cython.locals(start=double)
    cpdef double promote(self, Transfer tr, double t)

cdef inline double _roof(double a, double b, double serial)
cdef inline double _memory(double nbytes, double gemv_bytes, double mem, double gemv)
@cython.locals(s=double)
cpdef double one_row(double slots, double experts)

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
