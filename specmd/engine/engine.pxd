# The engine's C-level declarations (Cython reads this beside engine.py; plain Python never does): the
# drivers' per-layer-call entry points and the typed references to the cache manager and the clock.

cimport cython

from specmd.engine.cache cimport CacheManager
from specmd.engine.clock cimport Clock
from specmd.engine.record cimport GateRecord
from specmd.engine.stats cimport CacheStats


cdef class Engine:
    cdef dict __dict__
    cdef public object geom
    cdef public object spec
    cdef public object store
    cdef public object model
    cdef public object routing
    cdef public object miss
    cdef public object prefetch
    cdef public Clock clock
    cdef public CacheManager cache
    cdef public object view
    cdef public object timing_as
    cdef public long long calls
    cdef public long long predictions
    cdef long long _E
    cdef long long _Z
    cdef bint _routes
    cdef bint _predicts
    cdef bint _streams
    cdef bint _warming
    cdef long long _run_slots
    cdef long long _run_n
    cpdef begin_pass(self, kind, tokens, context, contexts=*)
    cpdef end_pass(self)
    @cython.locals(r=GateRecord)
    cpdef bint route(self, rec)
    @cython.locals(cache=CacheManager, clock=Clock, r=GateRecord, layer=long)
    cpdef layer(self, rec, index=*, weights=*)
    @cython.locals(st=CacheStats, r=GateRecord, layer=long, slots="long long")
    cdef _fidelity(self, rec, index, plan, long n)
