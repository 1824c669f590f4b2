# The statistics' C-level declarations (Cython reads this beside stats.py; plain Python never does): the
# cache manager updates these counters per request through C field access (per-layer counters as typed
# arrays: an increment is a C add, no int object). A counter added to PER_LAYER or
# a field added to CacheStats is declared here too (tests/test_native.py checks the two lists agree).

cdef class PassRecord:
    cdef public long long index
    cdef public object kind
    cdef public long long tokens
    cdef public double time_s
    cdef public double stall_s
    cdef public long long requests
    cdef public long long hits
    cdef public long long misses
    cdef public long long collision_misses
    cdef public long long capacity_bytes
    cdef public long long kv_bytes
    cdef public long long bytes_moved


cdef class CacheStats:
    cdef dict __dict__  # the outcome counters made on first use (CacheStats.add)
    cdef public long num_layers
    cdef public long long[:] requests
    cdef public long long[:] requests_router
    cdef public long long[:] hits
    cdef public long long[:] misses
    cdef public long long[:] collision_misses
    cdef public long long[:] evictions
    cdef public long long[:] evictions_pressure
    cdef public long long[:] prefetch_issued
    cdef public long long[:] prefetch_used
    cdef public long long[:] prefetch_late
    cdef public long long[:] prefetch_wasted
    cdef public long long[:] prefetch_skipped
    cdef public long long[:] streamed
    cdef public long long[:] layer_streams
    cdef public long long[:] stream_served
    cdef public long long[:] bytes_demand
    cdef public long long[:] bytes_prefetch
    cdef public long long[:] bytes_stream
    cdef public double[:] stall_s
    cdef public long long[:] dropped
    cdef public long long[:] substituted
    cdef public long long[:] host_computed
    cdef public long long[:] pred_true
    cdef public long long[:] pred_predicted
    cdef public long long[:] pred_actual
    cdef public list passes
    cdef public list extra
    cdef public long long peak_bytes
    cdef public long long slots_total
    cdef public long long slots_unchanged
    cdef public long long lifetime_sum
    cdef public long long lifetime_n
    cdef public list precisions
    cdef public dict _precision_index
    cdef public long long[:] fetched_n
    cdef public long long[:] moved_bytes
    cdef public long long[:] moved_any
    cpdef add(self, stat, long layer)
    cpdef count(self, Py_ssize_t i, long long nbytes, long long fetched)
