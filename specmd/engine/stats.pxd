# The statistics' C-level declarations (Cython reads this beside stats.py; plain Python never does): the
# cache manager updates these counters per request through C field access. A counter added to PER_LAYER or
# a field added to CacheStats is declared here too (tests/test_native.py checks the two lists agree).

cdef class CacheStats:
    cdef dict __dict__  # the outcome counters made on first use (CacheStats.add)
    cdef public long num_layers
    cdef public list requests
    cdef public list requests_router
    cdef public list hits
    cdef public list misses
    cdef public list collision_misses
    cdef public list evictions
    cdef public list prefetch_issued
    cdef public list prefetch_used
    cdef public list prefetch_late
    cdef public list prefetch_wasted
    cdef public list prefetch_skipped
    cdef public list streamed
    cdef public list bytes_demand
    cdef public list bytes_prefetch
    cdef public list stall_s
    cdef public list dropped
    cdef public list substituted
    cdef public list host_computed
    cdef public list pred_true
    cdef public list pred_predicted
    cdef public list pred_actual
    cdef public list passes
    cdef public list extra
    cdef public long long peak_bytes
    cdef public long long slots_total
    cdef public long long slots_unchanged
    cdef public long long lifetime_sum
    cdef public long long lifetime_n
    cdef public dict fetched_by_precision
    cdef public dict bytes_by_precision
    cpdef add(self, stat, long layer)
    cpdef count_precision(self, precision, nbytes, fetched=*)
