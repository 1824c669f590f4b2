# FlashMoE's ML eviction as an extension type (Cython reads this beside ml.py; plain Python never does).
from specmd.policies.eviction.base cimport EvictionPolicy, KeyHeap

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
    cdef _use(self, long long key)
    cdef _features(self, long layer, long expert)
    cpdef double distance(self, long layer, long expert)
    cdef double _forward(self, long layer)
