"""What the cache manager calls on a pool's eviction policy for every request, as extension types.

:class:`EvictionHooks` is the base every eviction policy derives from
(:class:`specmd.policies.eviction.base.EvictionPolicy`): ``on_insert``, ``on_access``, ``on_remove`` and
``victim`` are ``cpdef`` methods. A policy that is itself compiled as an extension type (a built-in policy
with its ``.pxd``, such as LRU and FIFO) overrides them with C methods, and the cache manager then calls
them in C: no Python call, no argument tuple, no bound method per request (:func:`compiled_hooks` tells the
two cases apart). A policy written as a plain Python class (a user's file, or a built-in policy not yet
compiled as an extension type) overrides them with Python methods; the manager calls its bound methods as
before, unchanged. Either way the policy sees only keys, the read-only view and an :class:`Evictable`.

:class:`Evictable` is what ``victim(evictable)`` receives: callable as ``evictable(key)`` from Python, and
``evictable.ok(key)`` in C. A policy asked for a victim with any other callable (a test's lambda) wraps it
with :func:`as_evictable`.
"""

from __future__ import annotations

HOOKS = ("on_insert", "on_access", "on_remove", "victim")  # what the manager calls per request
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement at run time (not an extension type)
COMPILED = not __file__.endswith(".py")  # this module runs as its extension (its file is the .so), not its source


class Evictable:
    """May ``key`` be evicted now? (The cache manager's answer: not a running call's expert, not a prefetch
    still in flight.)"""

    def ok(self, key: int) -> bool:
        raise NotImplementedError

    def __call__(self, key) -> bool:
        return self.ok(key)


class CallableEvictable(Evictable):
    """An :class:`Evictable` that asks a Python callable."""

    def __init__(self, fn):
        self.fn = fn

    def ok(self, key: int) -> bool:
        return bool(self.fn(key))


def as_evictable(evictable) -> Evictable:
    """``evictable`` as an :class:`Evictable` (itself when it is one)."""
    if isinstance(evictable, Evictable):
        return evictable
    return CallableEvictable(evictable)


class EvictionHooks:
    """The per-request hooks (the contract: :mod:`specmd.policies.eviction.base`). Keys are
    ``layer * num_experts + expert``."""

    def on_insert(self, key: int, prefetch: bool):
        raise NotImplementedError

    def on_access(self, key: int):
        raise NotImplementedError

    def on_remove(self, key: int):
        raise NotImplementedError

    def victim(self, evictable):
        raise NotImplementedError


def compiled_hooks(policy) -> bool:
    """Whether the manager may call ``policy``'s hooks in C: it is an :class:`EvictionHooks` and each of its
    :data:`HOOKS` is defined by an extension type (a compiled class), not by a Python class statement (a
    Python override: then the manager calls the bound Python methods, which is faster than C dispatching to
    them). Always False where this module runs as source."""
    if not COMPILED or not isinstance(policy, EvictionHooks):
        return False
    for name in HOOKS:
        owner = next(c for c in type(policy).__mro__ if name in c.__dict__)
        if owner.__flags__ & _HEAPTYPE:
            return False
    return True
