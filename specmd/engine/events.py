"""The seam an executor plugs into: the residency events the cache manager emits, and the layout of its pools.

The engine decides every cache question; an executor (``execution=offload``) only materialises the
decisions. It learns them through exactly two things declared here:

* :class:`PoolLayout` (``CacheManager.layout()``): how many pools, each one's capacity in bytes, and which
  pool each MoE layer's experts go to -- what an executor needs to pre-allocate one device arena per pool
  of exactly the configured capacity (Fiddler's and MoE-PolicyLang's pre-allocated slots);
* :class:`ResidencyEvents` (``CacheManager.subscribe(events)``): called by the manager, synchronously and in
  decision order, whenever residency changes. ``inserted`` when a copy enters a pool (a demand fetch or an
  admitted prefetch: the executor starts its transfer), ``evicted`` when one leaves (the executor frees its
  range; a transfer still queued into it is cancelled), ``streamed`` when a demand miss could not be cached
  (its bytes are needed for this layer call only: a staging area). Each layer call's events all arrive
  before the call's experts run.

One more thing is declared here for checks only (``execution.check=true``, tests), never read on a run's
path: :class:`ResidentSet`, the manager's resident set and its pools' bytes, which an executor's check
compares its arena with. Nothing else of the cache manager is read. Beside it, an executor reads only what
the stack hands it: the model's geometry (sizes to allocate), the store (bytes per precision; the raw
copies it moves), the clock's ``link_rate`` (the simulated channel's rate, which it paces copies to), and per
layer call the engine's plan (:class:`~specmd.engine.outcomes.Execution`) and the call's record (the
selection read back to the host).

Keys are ``layer * num_experts + expert``, as everywhere in the engine. An executor never makes a decision
in these callbacks and never raises for a decision it dislikes: the engine has already counted it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence


@dataclass(frozen=True)
class PoolLayout:
    """The cache's pools: ``capacities[p]`` bytes each, ``pool_of_layer[l]`` the pool of MoE layer ``l``'s
    experts (one global pool, or one per layer with ``hardware.scope=per_layer``)."""

    capacities: tuple[int, ...]
    pool_of_layer: tuple[int, ...]
    num_experts: int

    @property
    def num_layers(self) -> int:
        return len(self.pool_of_layer)

    def layers_of(self, pool: int) -> list[int]:
        return [l for l, p in enumerate(self.pool_of_layer) if p == pool]


class ResidencyEvents:
    """What the cache manager tells the one subscriber that materialises residency (``subscribe``). The
    defaults do nothing, so a subscriber overrides what it carries out."""

    def inserted(self, key: int, layer: int, precision: str, prefetched: bool) -> None:
        """A copy of ``key`` at ``precision`` entered its layer's pool (``prefetched``: an admitted
        prefetch, overlapping compute; else a demand fetch this layer call waits for)."""

    def evicted(self, key: int) -> None:
        """``key``'s copy left its pool (a victim, or a prefetch dropped before use)."""

    def streamed(self, layer: int, expert: int, precision: str) -> None:
        """A demand miss of this layer call that no pool could hold, or a miss of a streamed layer call
        (``hardware.stream_layers``): its bytes go to a staging area for this call only (the transfer is
        counted like any other)."""


class ResidentSet(Protocol):
    """What a check of an executor reads of the cache manager (``Offload.check_residency``): ``entries``,
    key -> the resident copy's entry (its ``precision``), and ``pools``, each pool's ``capacity`` and
    ``used`` bytes. Read only, and only to check (``execution.check=true``, tests); the manager is one."""

    entries: Mapping[int, Any]
    pools: Sequence[Any]
