"""Host memory the executors and the live driver allocate once and read on the host: the routing read-back's
buffers (:mod:`specmd.hook.readback`) and the expert map's pinned ring (:mod:`specmd.executor.placement`).

:func:`register_host` declares such a buffer. Nothing in a run reads the declaration: it is for the GPU-cost
proxy (:mod:`specmd.counting`), which counts a read of device memory on the host as a synchronisation and must
tell these buffers, host memory on a GPU machine too, from the device tensors around them. It lives here, not in
the proxy, so that production code does not import a measuring tool to allocate its buffers.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

_HOST: list = []  # weak references to the registered buffers (a WeakSet would compare tensors)
_WATCHERS: list = []  # callables told of each buffer registered while they watch (a proxy counting)
_lock = threading.Lock()


def register_host(t: torch.Tensor) -> torch.Tensor:
    """Declare ``t`` (a buffer allocated once) host memory: reading it is no synchronisation. Returns ``t``."""
    with _lock:
        _HOST[:] = [r for r in _HOST if r() is not None]
        _HOST.append(weakref.ref(t))
        for tell in _WATCHERS:
            tell(t)
    return t


def watch_host(tell: Callable[[torch.Tensor], None]) -> list:
    """Start telling ``tell`` of every buffer registered from now on; returns the live buffers registered so far
    (under one lock: none is missed between the two)."""
    with _lock:
        _WATCHERS.append(tell)
        return [t for t in (r() for r in _HOST) if t is not None]


def unwatch_host(tell: Callable[[torch.Tensor], None]) -> None:
    with _lock:
        _WATCHERS.remove(tell)
