# The C declarations of structures.py (Cython reads this beside it; plain Python never does): per-key arrays
# as typed memoryviews, the per-request methods as C calls. A policy's own .pxd cimports what it keeps.

cimport cython

from specmd.engine.hooks cimport Evictable, as_evictable


@cython.final
cdef class KeyLists:
    cdef long long[:] _next
    cdef long long[:] _prev
    cdef long long[:] _owner
    cdef long long[:] _front
    cdef long long[:] _back
    cdef long long[:] _size
    cdef long _lists
    @cython.locals(old=Py_ssize_t, n=Py_ssize_t, i=Py_ssize_t)
    cdef _grow(self, long long key)
    cdef _check(self, long long key, long lst)
    @cython.locals(back="long long")
    cpdef push_back(self, long long key, long lst=*)
    @cython.locals(lst="long long", after="long long", before="long long")
    cpdef remove(self, long long key)
    cpdef discard(self, long long key)
    @cython.locals(owner="long long", after="long long", before="long long", back="long long")
    cpdef move_back(self, long long key, long lst=*)
    @cython.locals(head="long long", key="long long", back="long long")
    cpdef splice(self, long src, long dst)
    @cython.locals(ev=Evictable, key="long long")
    cpdef first(self, long lst, evictable)
    cpdef long long owner(self, long long key)
    cpdef long long front(self, long lst)
    cpdef long long size(self, long lst)


@cython.final
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
    @cython.locals(key="long long", parent=Py_ssize_t)
    cdef _up(self, Py_ssize_t i)
    @cython.locals(key="long long", n=Py_ssize_t, child=Py_ssize_t)
    cdef _down(self, Py_ssize_t i)
    @cython.locals(i=Py_ssize_t)
    cpdef set(self, long long key, long long p1, long long p2)
    @cython.locals(b="long long")
    cpdef set_score(self, long long key, double score)
    cpdef bint contains(self, long long key)
    cpdef remove(self, long long key)
    @cython.locals(i=Py_ssize_t, last="long long")
    cpdef discard(self, long long key)
    @cython.locals(ev=Evictable, m=Py_ssize_t, j=Py_ssize_t, top="long long")
    cpdef first(self, evictable)
    cpdef long long top(self)
    cpdef long long rank(self, long long key)


@cython.final
cdef class LayerQueues:
    cdef public long num_layers
    cdef public KeyLists lists
    cdef public object order
    cdef dict _scans
    cpdef add(self, long layer, long long key, long kind=*)
    cpdef discard(self, long long key)
    @cython.locals(L=long, layer=long)
    cpdef merge(self, long src, long dst)
    @cython.locals(ev=Evictable, lists=KeyLists, base=long, layer=long)
    cpdef first(self, long current, evictable, long kind=*)
