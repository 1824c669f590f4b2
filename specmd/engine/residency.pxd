# The residency's C-level declarations (Cython reads this beside residency.py; plain Python never does). The
# layer call and the cache manager cimport these types so their calls into the residency are C calls. A field
# or hot method added to residency.py is declared here; native.py runs every module that cimports this one as
# source whenever residency.py runs as source (and this one whenever clock.py or stats.py does).

cimport cython

from specmd.engine.clock cimport Clock
from specmd.engine.hooks cimport EvictionHooks, Evictable
from specmd.engine.stats cimport CacheStats


cdef class Residency  # (declared below; _Evictable refers to it)


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
    @cython.locals(e="long long")
    cdef long long _expert(self, x, long layer) except? -1
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
    @cython.locals(nbytes="long long", prec=int, key="long long", e="long long", streamed=long, clock=Clock,
                   E="long long", st=CacheStats, n=Py_ssize_t)
    cpdef long long demand(self, Pool pool, long layer, long long base, experts, precision, list waits) except -1
    cpdef evict(self, key)
    @cython.locals(k="long long", here="signed char[:]", layer=long, nbytes="long long", pool=Pool, st=CacheStats)
    cdef _evict(self, key)
