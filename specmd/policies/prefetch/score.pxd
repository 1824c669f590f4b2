# The C declarations of score.py's inner loops (Cython reads this beside it; plain Python never does): the
# threshold's sorted-window merge and the per-token selection run over typed buffers in C.

cimport cython


@cython.locals(i=Py_ssize_t, j=Py_ssize_t, k=Py_ssize_t, o=Py_ssize_t, v=float, ng=Py_ssize_t, nn=Py_ssize_t)
cdef Py_ssize_t _merge(float[::1] s, Py_ssize_t n, float[::1] gone, float[::1] new, float[::1] out)

@cython.locals(t=Py_ssize_t, e=Py_ssize_t)
cdef bint _holds(float[:, :] rows, float a)

@cython.locals(T=Py_ssize_t, E=Py_ssize_t, t=Py_ssize_t, e=Py_ssize_t, i=Py_ssize_t, m=Py_ssize_t, r=float)
cdef list _chosen(float[:, :] rows, float a, float b, bint take_a, float[::1] best, long long[::1] order)
