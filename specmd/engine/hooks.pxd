# The eviction hooks' C-level declarations (Cython reads this beside hooks.py; plain Python never does): the
# cache manager calls a compiled policy's hooks through these, and compiled policies ask an Evictable in C.

cdef class Evictable:
    cpdef bint ok(self, long long key)

cdef class CallableEvictable(Evictable):
    cdef object fn

cpdef Evictable as_evictable(evictable)

cdef class EvictionHooks:
    cdef dict __dict__  # a policy's own state beyond its declared fields
    cpdef on_insert(self, long long key, bint prefetch)
    cpdef on_access(self, long long key)
    cpdef on_remove(self, long long key)
    cpdef victim(self, evictable)
