# The eviction bases' C-level declarations (Cython reads this beside base.py; plain Python never does): a
# built-in policy compiled as an extension type cimports its base from here (its own .pxd, e.g. lru.pxd).

from specmd.engine.hooks cimport EvictionHooks, Evictable, as_evictable


cdef class EvictionPolicy(EvictionHooks):
    pass


cdef class OrderedEviction(EvictionPolicy):
    cdef public dict _order


cdef class KeyLists:
    cdef long long[:] _next
    cdef long long[:] _prev
    cdef long long[:] _owner
    cdef long long[:] _front
    cdef long long[:] _back
    cdef long long[:] _size
    cdef _link_back(self, long long key, long lst)
    cdef _unlink(self, long long key)
    cdef _check(self, long long key, long lst)
    cpdef push_back(self, long long key, long lst=*)
    cpdef remove(self, long long key)
    cpdef discard(self, long long key)
    cpdef move_back(self, long long key, long lst=*)
    cpdef splice(self, long src, long dst)
    cpdef first(self, long lst, evictable)
    cpdef long long owner(self, long long key)
    cpdef long long front(self, long lst)
    cpdef long long size(self, long lst)


cdef class LayerQueues:
    cdef public long num_layers
    cdef public KeyLists lists
    cdef public object order
    cdef dict _scans
    cpdef add(self, long layer, long long key, long kind=*)
    cpdef discard(self, long long key)
    cpdef merge(self, long src, long dst)
    cpdef first(self, long current, evictable, long kind=*)


cdef class KeyHeap:
    cdef long long[:] _pos
    cdef long long[:] _p1
    cdef long long[:] _p2
    cdef long long[:] _heap
    cdef long long[:] _aside
    cdef Py_ssize_t _n
    cdef object _bits
    cdef double[:] _double
    cdef long long[:] _int
    cdef bint _less(self, long long a, long long b)
    cdef _place(self, Py_ssize_t i, long long key)
    cdef _up(self, Py_ssize_t i)
    cdef _down(self, Py_ssize_t i)
    cpdef set(self, long long key, long long p1, long long p2)
    cpdef set_score(self, long long key, double score)
    cpdef bint contains(self, long long key)
    cpdef remove(self, long long key)
    cpdef discard(self, long long key)
    cpdef first(self, evictable)
    cpdef long long top(self)
    cpdef long long rank(self, long long key)
