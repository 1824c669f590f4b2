# The eviction bases' C declarations (Cython reads this beside base.py; plain Python never does): a built-in
# policy compiled as an extension type cimports its base from here (its own .pxd, e.g. lru.pxd), and the
# structures it keeps its order in from structures.pxd.

cimport cython

from specmd.engine.hooks cimport EvictionHooks, Evictable, as_evictable


cdef class EvictionPolicy(EvictionHooks):
    pass


cdef class OrderedEviction(EvictionPolicy):
    cdef public dict _order
    @cython.locals(ev=Evictable)
    cpdef victim(self, evictable)
