# The cache manager's C-level declarations (Cython reads this beside cache.py; plain Python never does).
# The engine cimports these types so its calls into the manager are C calls. A field or hot method added
# to cache.py is declared here; native.py runs every module that cimports this one as source whenever
# cache.py runs as source (and this one whenever clock.py or stats.py does).

cimport cython

from specmd.engine.clock cimport Clock
from specmd.engine.hooks cimport EvictionHooks, Evictable
from specmd.engine.stats cimport CacheStats


cdef class CacheManager  # (declared below; LayerCall refers to it)


@cython.final
cdef class Pool:
    cdef public long long capacity
    cdef public long long used
    cdef public object policy
    cdef public bint native  # the policy's hooks are C methods (hooks.compiled_hooks): called through ``hooks``
    cdef public EvictionHooks hooks  # the policy, typed (None unless ``native``)
    cdef public object on_miss
    cdef public object on_admit
    cdef public object on_layer
    cdef public object on_pass_start
    # the policy's hooks the manager calls per request, bound once
    cdef public object on_insert
    cdef public object on_access
    cdef public object on_remove
    cdef public object victim
    cdef access(self, long long key)
    cdef inserted(self, long long key, bint prefetch)
    cdef removed(self, long long key)
    cdef choose_victim(self, evictable)


cdef class LayerCall:
    cdef public CacheManager _m
    cdef public long layer
    cdef public long long base
    cdef public Pool pool
    cdef public object record
    cdef public list waits
    cdef public object execution
    cdef public long long host_slots
    cdef public long long host_experts
    cdef public object host_handle
    cdef public long long demanded
    cdef public object fetch_precision
    cdef public object index
    cdef public object weights
    cdef public long n
    cpdef reset(self, long layer, long long base, Pool pool, record, index, weights, long n)
    cpdef fetch_many(self, experts, precision)


cdef class _Evictable(Evictable):
    cdef CacheManager _m


cdef class CacheManager:
    cdef public object geom
    cdef public object precisions
    cdef public object miss
    cdef public object fetch_precision
    cdef public Clock clock
    cdef public CacheStats stats
    cdef public object measure
    cdef public object _uncounted
    cdef public list pools
    cdef public list _pool_of_layer
    cdef public object events
    cdef public long long used_bytes
    cdef long long _nkeys
    cdef signed char[:] _here
    cdef signed char[:] _prefetched
    cdef signed char[:] _used
    cdef long long[:] _nbytes
    cdef long long[:] _since
    cdef int[:] _prec
    cdef list _transfer
    cdef list _precs
    cdef dict _prec_id
    cdef int _native
    cdef bint _miss_passive
    cdef bint _fetch_native
    cdef long long[:] _pin
    cdef long long _stamp
    cdef long long[:] _evicted_at
    cdef dict _bytes_of
    cdef dict _bits_of
    cdef public long long pass_index
    cdef public object current_pass
    cdef public list predicted
    cdef public LayerCall _call
    cdef public object view
    cdef public object _default_fetch
    cdef long long _E
    cdef _Evictable _evictable
    cpdef begin_pass(self, kind, tokens, context)
    cpdef end_pass(self)
    cpdef LayerCall serve(self, long layer, experts, record=*, index=*, weights=*)
    cpdef LayerCall _open(self, long layer, experts, record, index, weights)
    cdef _serve_hits(self, LayerCall call, experts)
    cdef _serve_misses(self, LayerCall call, missing)
    cpdef _stall(self, LayerCall call)
    cpdef finish_layer(self)
    cpdef pin(self, long long key)
    cpdef bint evictable(self, long long key)
    cpdef bint make_room(self, Pool pool, long long nbytes)
    cdef _uncount_prefetches(self)
    cpdef bint has(self, long long key)
    cpdef precision_of(self, long long key)
    cpdef transfer_of(self, long long key)
    cdef _insert(self, long long key, long layer, long long nbytes, Pool pool, transfer, bint prefetched, int prec, bint used)
    cpdef evict(self, key)
    cdef _evict(self, key)
