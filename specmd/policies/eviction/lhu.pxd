# LHU as an extension type on LFU's (Cython reads this beside lhu.py; plain Python never does).
from specmd.policies.eviction.lfu cimport LFU

cdef class LHU(LFU):
    cdef public long long high_bits
    cdef public bint _all_high
    cpdef long long weight(self, long long key)
