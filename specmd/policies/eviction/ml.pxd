# FlashMoE's ML eviction as an extension type (Cython reads this beside ml.py; plain Python never does).

cimport cython
from specmd.policies.eviction.base cimport EvictionPolicy
from libc.math cimport exp
from specmd.policies.eviction.structures cimport KeyHeap

cdef class ML(EvictionPolicy):
    cdef public long E
    cdef public long H
    cdef public KeyHeap _heap
    cdef public long long[:] step
    cdef public double[:] fmax
    cdef public long long[:, :] last
    cdef public double[:, :] freq
    cdef public long long[:] _dirty
    cdef public long long[:] _resident
    cdef public double[::1] _w1
    cdef public double[::1] _w2
    cdef public double[::1] _w3
    cdef public double[::1] _b1
    cdef public double[::1] _b2
    cdef public double[::1] _b3
    cdef public double[::1] _h1
    cdef public double[::1] _h2
    cdef public float[::1] _x
    @cython.locals(layer="long long")
    cdef long long _layer(self, long long key) except? -1
    @cython.locals(layer="long long", e="long long", f=double)
    cdef _use(self, long long key)
    @cython.locals(s="long long", x0=double, x1=double)
    cdef _features(self, long layer, long expert)
    cpdef double distance(self, long layer, long expert)
    @cython.locals(layer="long long")
    cpdef on_remove(self, long long key)
    @cython.locals(H=Py_ssize_t, w1="double[::1]", w2="double[::1]", w3="double[::1]", b1="double[::1]", b2="double[::1]", h1="double[::1]", h2="double[::1]", x0=double, x1=double, low=double, i=Py_ssize_t, j=Py_ssize_t, z=double, a=double, o1=Py_ssize_t, ob=Py_ssize_t, o2=Py_ssize_t, out=double)
    cdef double _forward(self, long layer)
    @cython.locals(layer="long long")
    cpdef on_insert(self, long long key, bint prefetch)
    @cython.locals(layer=Py_ssize_t, e=Py_ssize_t, base="long long", heap=KeyHeap)
    cpdef victim(self, evictable)
