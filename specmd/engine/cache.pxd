# The cache manager's C-level declarations (Cython reads this beside cache.py; plain Python never does).
# The engine cimports these types so its calls into the manager are C calls. A field or hot method added
# to cache.py is declared here; native.py runs every module that cimports this one as source whenever
# cache.py runs as source (and this one whenever clock.py or stats.py does).
# cache.py itself is plain Python: every C type of it is here (the fields, the C signatures, and each
# function's typed locals as @cython.locals above its declaration).

cimport cython

from specmd.engine.clock cimport Clock
from specmd.engine.hooks cimport EvictionHooks, Evictable
from specmd.engine.stats cimport CacheStats


cdef class Residency  # (declared below; _Evictable refers to it)
cdef class CacheManager  # (declared below; LayerCall refers to it)
cdef class LayerStreaming  # (declared below)


@cython.locals(t="long long", i=Py_ssize_t)
cdef long long _total(long long[:] counts)

@cython.locals(e="long long")
cdef long long _expert(x, long layer, long long E) except? -1


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
    @cython.locals(m=CacheManager, nbytes="long long", prec=int, pool=Pool, base="long long", layer=long,
                   key="long long", e="long long", streamed=long, clock=Clock, waits=list, E="long long",
                   st=CacheStats, n=Py_ssize_t)
    cpdef fetch_many(self, experts, precision)


cdef class _Evictable(Evictable):
    cdef Residency _m
    @cython.locals(m=Residency)
    cpdef bint ok(self, long long key)


cdef class Residency:
    cdef public object geom
    cdef public object precisions
    cdef public Clock clock
    cdef public CacheStats stats
    cdef public list pools
    cdef public list _pool_of_layer
    cdef public list ceilings
    cdef public long long kv_bytes
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
    cdef long long[:] _pin
    cdef long long _stamp
    cdef long long[:] _evicted_at
    cdef dict _bytes_of
    cdef dict _bits_of
    cdef public long long pass_index
    cdef long long _E
    cdef _Evictable _evictable
    cpdef pin(self, long long key)
    cpdef bint evictable(self, long long key)
    cpdef bint make_room(self, Pool pool, long long nbytes)
    @cython.locals(pool=Pool, st=CacheStats, i=Py_ssize_t, victim="long long", layer=long, cap="long long")
    cpdef resize(self, list capacities, long long kv_bytes)
    @cython.locals(key="long long")
    cdef long long _arriving(self, Pool pool) except -1
    @cython.locals(here="signed char[:]", prefetched="signed char[:]", used="signed char[:]", key=Py_ssize_t)
    cdef _uncount_prefetches(self)
    cpdef bint has(self, long long key)
    cpdef precision_of(self, long long key)
    cpdef transfer_of(self, long long key)
    cdef _insert(self, long long key, long layer, long long nbytes, Pool pool, transfer, bint prefetched, int prec, bint used)
    cpdef evict(self, key)
    @cython.locals(k="long long", here="signed char[:]", layer=long, nbytes="long long", pool=Pool, st=CacheStats)
    cdef _evict(self, key)


cdef class CacheManager(Residency):
    cdef public object miss
    cdef public object fetch_precision
    cdef public object measure
    cdef public object _uncounted
    cdef bint _miss_passive
    cdef bint _fetch_native
    cdef public object current_pass
    cdef public list predicted
    cdef public LayerCall _call
    cdef public object view
    cdef public object _default_fetch
    cdef public LayerStreaming streaming
    @cython.locals(pool=Pool, s=CacheStats)
    cpdef begin_pass(self, kind, tokens, context)
    @cython.locals(clock=Clock, s=CacheStats)
    cpdef end_pass(self)
    @cython.locals(t="long long", pool=Pool)
    cdef long long _capacity(self)
    @cython.locals(s=CacheStats)
    cdef long long _moved(self)
    @cython.locals(call=LayerCall)
    cpdef LayerCall serve(self, long layer, experts, record=*, index=*, weights=*)
    @cython.locals(stamp="long long", pin="long long[:]", E="long long", base="long long", e="long long",
                   pool=Pool, st=CacheStats, call=LayerCall)
    cpdef LayerCall _open(self, long layer, experts, record, index, weights)
    @cython.locals(here="signed char[:]", prec="int[:]", used="signed char[:]", prefetched="signed char[:]",
                   transfers=list, native=int, st=CacheStats, layer=long, base="long long", key="long long",
                   e="long long", hits=long, pool=Pool, compiled=bint, hooks=EvictionHooks, clock=Clock,
                   E="long long")
    cdef _serve_hits(self, LayerCall call, experts)
    @cython.locals(layer=long)
    cdef _serve_misses(self, LayerCall call, missing)
    @cython.locals(layer=long, base="long long", st=CacheStats, evicted_at="long long[:]", now="long long",
                   e="long long", collisions=long)
    cdef _count_misses(self, LayerCall call, missing)
    @cython.locals(clock=Clock)
    cpdef _stall(self, LayerCall call)
    @cython.locals(call=LayerCall)
    cpdef finish_layer(self)
    @cython.locals(E="long long", base="long long", pool=Pool, nbytes="long long", pid=int, key="long long",
                   e="long long", st=CacheStats)
    cpdef prefetch(self, layer, experts)


cdef class LayerStreaming:
    cdef public CacheManager _m
    cdef public long long at
    cdef public long layer
    cdef public object experts
    cdef public object handle
    cdef public bint ahead
    cpdef drop(self)
    @cython.locals(m=CacheManager, layer=long, st=CacheStats, e="long long", late=long, nbytes="long long",
                   native=bint, needs_stage=bint)
    cdef serve(self, LayerCall call, experts)
    @cython.locals(m=CacheManager, layer=long, E="long long", base="long long", here="signed char[:]",
                   e="long long", nbytes="long long", st=CacheStats)
    cpdef stage_ahead(self)
