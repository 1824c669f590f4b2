"""Eviction policies (SpecMD §3.1.3, App. B) choose the victim when a cache pool is full.

The cache manager keeps one policy instance per pool (one pool in ``hardware.scope=global``, one per
MoE layer in ``per_layer``) and tells it about every insert, hit and removal. Keys are ints
``layer * num_experts + expert`` (``layer`` is the MoE-layer ordinal); ``self.keys`` converts.
``victim(evictable)`` returns the key to evict among those for which ``evictable(key)`` is true (the
manager excludes the experts the running layer uses and prefetches still in flight), or ``None``.

Hooks with a default no-op: ``on_pass_start`` (a new forward pass), ``on_layer`` (execution reached a
MoE layer). Oracle policies (Belady, trace replay) will get the future through ``on_pass_start``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...registry import Registry
from ..base import Policy


class KeySpace:
    __slots__ = ("num_experts",)

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def split(self, key: int) -> tuple[int, int]:
        return divmod(key, self.num_experts)


class EvictionPolicy(Policy):
    def __init__(self, params: Any = None, keys: Optional[KeySpace] = None):
        super().__init__(params)
        self.keys = keys

    def on_insert(self, key: int, prefetch: bool) -> None:
        raise NotImplementedError

    def on_access(self, key: int) -> None:
        raise NotImplementedError

    def on_remove(self, key: int) -> None:
        raise NotImplementedError

    def victim(self, evictable: Callable[[int], bool]) -> Optional[int]:
        raise NotImplementedError

    def on_pass_start(self, pass_index: int) -> None:
        pass

    def on_layer(self, layer: int) -> None:
        pass


EVICTION: Registry[EvictionPolicy] = Registry("eviction", "specmd.policies.eviction")
