# The cache manager's C-level declarations (Cython reads this beside cache.py; plain Python never does).
# The engine cimports these types so its calls into the manager are C calls. A field or hot method added
# to cache.py is declared here; native.py runs every module that cimports this one as source whenever
# cache.py runs as source (and this one whenever clock.py or stats.py does).
# cache.py itself is plain Python: every C type of it is here (the fields, the C signatures, and each
# function's typed locals as @cython.locals above its declaration).

cimport cython

from specmd.engine.call cimport LayerCall
from specmd.engine.clock cimport Clock
from specmd.engine.hooks cimport EvictionHooks
from specmd.engine.residency cimport Pool, Residency
from specmd.engine.stats cimport CacheStats


cdef class CacheManager  # (declared below; LayerStreaming refers to it)
cdef class LayerStreaming  # (declared below)


@cython.locals(t="long long", i=Py_ssize_t)
cdef long long _total(long long[:] counts)


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
