# LRU as an extension type (Cython reads this beside lru.py; plain Python never does).
from specmd.policies.eviction.fifo cimport FIFO

cdef class LRU(FIFO):
    pass
