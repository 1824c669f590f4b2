# cython: wraparound=False
# (every index in this module is non-negative: a key, a layer, an expert, each checked where it enters)
"""What the cache holds: the engine's residency. Per key (``layer * num_experts + expert``), resident or
arriving, its bytes, stored precision, pending transfer, pin and history; per pool, its byte budget and its
eviction policy. :class:`Residency` inserts and evicts (telling the pool's policy and the executor's
subscriber, :class:`~specmd.engine.events.ResidencyEvents`) and answers what is cached; what to insert and
when is the cache manager's (:mod:`specmd.engine.cache`), which extends it.

Semantics (docs/semantics.md "Cache semantics"):
* Capacity is a byte budget per pool (one global pool, or one per MoE layer). Prefetches reserve their
  space when issued. The experts of the running layer and prefetches still in flight are never evicted
  (:meth:`Residency.evictable`, what a policy's ``victim`` asks).
* A pool whose budget shrinks (the device's memory per pass, per-layer budgets: :meth:`Residency.resize`)
  evicts its policy's victims until it fits, counted as ``evictions_pressure``.
* An eviction of a prefetched copy never requested counts as a wasted prefetch; so does one still resident
  at the end of the run (:meth:`Residency.finalize`).
"""

from __future__ import annotations

import operator
from array import array
from collections import namedtuple
from typing import Optional

from .clock import Clock
from .events import PoolLayout
from .geometry import Geometry
from .hooks import Evictable, compiled_hooks
from .outcomes import NATIVE
from .stats import CacheStats
from .store import StoreSizes


class Pool:
    """A byte budget and its eviction policy. (Fields: ``residency.pxd``.)"""

    def __init__(self, capacity: int, policy):
        self.capacity = capacity
        self.used = 0
        self.policy = policy
        # The hooks called per request: in C when the policy's class compiles them (``hooks``: the policy,
        # typed; ``native``), else its bound Python methods, bound once (no attribute lookup per call).
        self.native = compiled_hooks(policy)
        self.hooks = policy if self.native else None
        self.on_insert = policy.on_insert
        self.on_access = policy.on_access
        self.on_remove = policy.on_remove
        self.victim = policy.victim
        # The optional hooks, each the policy's bound method or None when it keeps the base class's no-op
        # (then the manager makes no call at all): ``on_miss`` per demand miss (``miss_hook()``), ``on_admit``
        # per fetch or prefetch about to be inserted, ``on_layer`` per layer call.
        self.on_miss = policy.miss_hook() if hasattr(policy, "miss_hook") else None
        hook = getattr(policy, "hook", None)
        self.on_admit = hook("on_admit") if hook is not None else policy.on_admit
        self.on_layer = hook("on_layer") if hook is not None else policy.on_layer
        self.on_pass_start = hook("on_pass_start") if hook is not None else policy.on_pass_start

    # (The manager calls the per-request hooks as ``pool.hooks.on_access(key) if pool.native else
    # pool.on_access(key)``, written out where it calls them: no call of its own per request.)


Entry = namedtuple("Entry", "key layer nbytes precision bits transfer prefetched used since")
Entry.__doc__ = """A snapshot of one resident (or arriving) expert, made when read (:meth:`CacheManager.entry`,
``entries``): the manager keeps these fields as per-key arrays, so serving a request makes no object.
``transfer``: the clock's handle while a prefetch has not been requested yet (else None); ``precision`` /
``bits``: the stored precision of this copy; ``since``: the forward pass it was inserted in (cache
lifetime); ``prefetched`` / ``used``: inserted by a counted prefetch / requested since."""


class _Evictable(Evictable):
    """The manager's answer to a policy's ``evictable(key)`` (:meth:`CacheManager.evictable`), without
    handing the policy the manager."""

    def __init__(self, manager):
        self._m = manager

    def ok(self, key: int) -> bool:
        m = self._m
        # not in the cache (a policy asking about a ghost; bounds-safe), pinned by the running layer call
        if not (0 <= key < m._nkeys and m._here[key]) or m._pin[key] == m._stamp:
            return False
        tr = m._transfer[key]
        return tr is None or m.clock.done(tr)


class Residency:
    """What the cache holds: per key, resident or arriving, its bytes, precision, pending transfer, pin and
    history; per pool, its policy and bytes used. It inserts and evicts (telling the pool's policy and the
    residency subscriber, counting evictions and wasted prefetches) and answers what is cached; deciding what
    to insert is :class:`~specmd.engine.cache.CacheManager`'s. (Fields: ``residency.pxd``.)"""

    def __init__(self, geom: Geometry, capacities: list[int], evictions: list, clock: Clock, store=None):
        """``evictions``: one eviction policy instance per pool (see ``pool_capacities``); ``store``: an
        :class:`~specmd.engine.store.StoreSizes` (its ``bytes_of`` / ``bits_of``; default native only)."""
        self.geom = geom
        self.precisions = store or StoreSizes.native_only(geom)
        self.clock = clock
        self.stats = CacheStats(geom.num_layers, list(self.precisions.bytes_of))
        self.pools = [Pool(c, p) for c, p in zip(capacities, evictions)]
        # each pool's most bytes (what an executor's arena holds): its capacity throughout, unless the device's
        # memory sets a capacity per pass (``resize``, never above it)
        self.ceilings = [int(c) for c in capacities]
        self.kv_bytes = -1  # the KV cache of the pass (``resize``); -1: not modelled (a fixed capacity)
        self._pool_of_layer = self.pools * geom.num_layers if len(self.pools) == 1 else list(self.pools)
        # who materialises residency (a :class:`~specmd.engine.events.ResidencyEvents`: ``subscribe``), or
        # None; it follows the manager's decisions and never makes one
        self.events = None
        self.used_bytes = 0  # over all pools
        # Residency, per key (``layer * num_experts + expert``), as arrays instead of an object per entry
        # (no allocation per miss; ``entries`` and ``entry`` make snapshots from them): ``_here`` resident or
        # arriving (the one record of residency), its ``_nbytes``, ``_prec`` (an index into ``_precs``, the
        # store's precisions), ``_since`` (the pass that inserted it), ``_prefetched`` / ``_used`` (inserted
        # by a counted prefetch / requested since), ``_transfer`` (the clock's handle while a prefetch is
        # pending, else None). Besides residency: ``_pin`` the layer call that pins the key (pinned while that
        # equals ``_stamp``, which every layer call's start and finish advance); ``_evicted_at`` the forward
        # pass that last evicted it (a collision miss is a miss on a key evicted in the current pass).
        nkeys = geom.num_layers * geom.num_experts
        self._nkeys = nkeys
        self._here = array("b", [0]) * nkeys
        self._prefetched = array("b", [0]) * nkeys
        self._used = array("b", [0]) * nkeys
        self._nbytes = array("q", [0]) * nkeys
        self._since = array("q", [0]) * nkeys
        self._prec = array("i", [0]) * nkeys
        self._transfer = [None] * nkeys
        self._pin = array("q", [-1]) * nkeys
        self._stamp = 0
        self._evicted_at = array("q", [-(1 << 62)]) * nkeys
        self.pass_index = -1
        self._E = geom.num_experts
        self._bytes_of = self.precisions.bytes_of  # (the store's own dicts, typed for the request path)
        self._bits_of = self.precisions.bits_of
        self._precs = list(self._bytes_of)  # a resident copy's precision is ``_precs[_prec[key]]``
        self._prec_id = {p: i for i, p in enumerate(self._precs)}
        self._native = self._prec_id.get(NATIVE, -1)
        self._evictable = _Evictable(self)  # what policies' ``victim`` asks, made once

    # ---- the executor's seam (specmd.engine.events) -----------------------------------------------
    def layout(self) -> PoolLayout:
        """The pools as an executor needs them: capacities in bytes, and each MoE layer's pool."""
        return PoolLayout(tuple(self.ceilings),
                          tuple(self.pools.index(p) for p in self._pool_of_layer), int(self._E))

    def subscribe(self, events) -> None:
        """``events`` (a :class:`~specmd.engine.events.ResidencyEvents`) carries out every residency change
        from now on: one subscriber per manager, before any request (it must see every insert)."""
        if self.events is not None and self.events is not events:
            raise RuntimeError("the cache manager already has a residency subscriber (one executor per engine)")
        if self.used_bytes:
            raise RuntimeError("subscribe before the first request: the subscriber would miss resident copies")
        self.events = events

    def _expert(self, x, layer: int) -> int:
        """``x`` as an expert index of ``layer``, checked: the one gate of the request path's unchecked array
        reads. An integer (numpy's too) in ``0 .. E - 1``; anything else is an IndexError or, a float, a
        TypeError (compiled, never truncated to a key). The request path's loops make the common case's check
        inline (``type(x) is int and 0 <= x < E``: no call per request) and call this for any other."""
        if not isinstance(x, int):
            x = operator.index(x)
        e = x
        if e < 0 or e >= self._E:
            raise IndexError(f"expert {e} of layer {layer}: the model has {self._E} experts per layer")
        return e

    # ---- residency ------------------------------------------------------------------------------
    @property
    def entries(self) -> dict:
        """The resident (or arriving) entries by key, ascending, as :class:`Entry` snapshots: a new dict per
        read (for checks, tests and results; the request path reads the per-key arrays)."""
        return {k: self.entry(k) for k in range(self._nkeys) if self._here[k]}

    def entry(self, key: int) -> Optional[Entry]:
        """A snapshot of ``key``'s entry, or None when it is not in the cache (or not a key of this model)."""
        if not self.has(key):
            return None
        prec = self._precs[self._prec[key]]
        return Entry(key, key // self._E, self._nbytes[key], prec, self._bits_of[prec], self._transfer[key],
                     bool(self._prefetched[key]), bool(self._used[key]), self._since[key])

    def has(self, key: int) -> bool:
        """``key`` is in the cache, arrived or arriving (False for a key outside the model)."""
        return 0 <= key < self._nkeys and self._here[key] != 0

    def precision_of(self, key: int):
        """The stored precision of ``key``'s copy, or None when it is not in the cache."""
        return self._precs[self._prec[key]] if self.has(key) else None

    def transfer_of(self, key: int):
        """The clock's handle of ``key``'s pending prefetch, or None (arrived, fetched, or not in the cache)."""
        return self._transfer[key] if self.has(key) else None

    def pin(self, key: int):
        """``key`` stays resident until the running layer call finishes."""
        if not 0 <= key < self._nkeys:  # (an IndexError, never a stray write: compiled, written unchecked)
            raise IndexError(f"key {key} of {self._nkeys}")
        self._pin[key] = self._stamp

    def evictable(self, key: int) -> bool:
        """Whether ``key`` may be evicted now (what a policy's ``victim`` asks: :class:`_Evictable`)."""
        return self._evictable.ok(key)

    def make_room(self, pool: Pool, nbytes: int) -> bool:
        if nbytes > pool.capacity:
            return False
        evictable = self._evictable
        while pool.capacity - pool.used < nbytes:
            # the pool's policy's victim: in C when it compiles it, else its bound Python method
            victim = pool.hooks.victim(evictable) if pool.native else pool.victim(evictable)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def resize(self, capacities: list, kv_bytes: int) -> None:
        """Each pool's budget set to ``capacities[p]`` bytes (at most its ceiling) for the pass about to start,
        whose KV cache is ``kv_bytes`` (-1: not modelled): the device's memory per pass (``hardware.memory_gb``,
        :class:`~specmd.engine.memory.DeviceMemory`) or per-layer budgets (:mod:`specmd.engine.budget`). A pool
        over its new budget evicts its policy's victims until it fits -- counted as evictions and as
        ``evictions_pressure``, at the boundary before the pass (a later miss on one is no collision miss, and it
        counts under ``stack.measure=decode`` too); with no victim left (only copies still arriving, a prefetch
        of the last pass never requested), those go in key order, their transfer wasted."""
        self.kv_bytes = kv_bytes
        st = self.stats
        for i in range(len(self.pools)):
            pool = self.pools[i]
            cap = capacities[i]
            if cap > self.ceilings[i]:
                cap = self.ceilings[i]
            if cap != pool.capacity:
                pool.capacity = cap
                pool.policy.resized(cap)  # (ARC's and LeCaR's c follow the pool)
            while pool.used > pool.capacity:
                victim = pool.hooks.victim(self._evictable) if pool.native else pool.victim(self._evictable)
                if victim is None:
                    victim = self._arriving(pool)
                layer = victim // self._E
                self._evict(victim)
                st.evictions_pressure[layer] += 1

    def _arriving(self, pool: Pool) -> int:
        """The first key (ascending) in ``pool``, which :meth:`resize` evicts when its policy names no victim."""
        for key in range(self._nkeys):
            if self._here[key] and self._pool_of_layer[key // self._E] is pool:
                return key
        raise RuntimeError("a pool over its budget holds no key (its bytes and its keys disagree)")

    def insert(self, key: int, layer: int, nbytes: int, pool: Pool, transfer, prefetched: bool, precision=NATIVE,
               used: bool = False) -> None:
        """``key`` enters ``pool`` (which must have room): ``transfer`` its pending prefetch's handle or None,
        ``precision`` one of the store's, ``used`` already requested (a demand fetch)."""
        if not 0 <= key < self._nkeys or layer != key // self._E or pool is not self._pool_of_layer[layer]:
            raise IndexError(f"key {key} (layer {layer}): not a key of this model, or not of that layer and its pool")
        self._insert(key, layer, nbytes, pool, transfer, prefetched, self._prec_id[precision], used)

    def _insert(self, key: int, layer: int, nbytes: int, pool: Pool, transfer, prefetched: bool, prec: int,
                used: bool):
        """:meth:`insert` with the precision's index in ``_precs`` (the request path's C call)."""
        if key < 0 or key >= self._nkeys:  # (a negative key would wrap to the model's last ones)
            raise IndexError(f"key {key} of {self._nkeys}")
        self._here[key] = 1
        self._nbytes[key] = nbytes
        self._prec[key] = prec
        self._since[key] = self.pass_index
        self._prefetched[key] = prefetched
        self._used[key] = used
        self._transfer[key] = transfer
        pool.used += nbytes
        self.used_bytes += nbytes
        if pool.native:
            pool.hooks.on_insert(key, prefetched)
        else:
            pool.on_insert(key, prefetched)
        if self.events is not None:
            self.events.inserted(key, layer, self._precs[prec], prefetched)
        if self.used_bytes > self.stats.peak_bytes:
            self.stats.peak_bytes = self.used_bytes

    def demand(self, pool: Pool, layer: int, base: int, experts, precision, waits: list) -> int:
        """Blocking transfers of ``experts`` of ``layer`` (keys ``base + e``) at ``precision``, in order: each
        inserted into ``pool`` if room can be made, else streamed (its bytes staged for this call only); the
        clock's handles appended to ``waits``. Returns how many (the one home for the demand-fetch accounting)."""
        nbytes = self._bytes_of[precision]
        prec = self._prec_id[precision]
        streamed = 0
        clock = self.clock
        admit = pool.on_admit
        events = self.events
        E = self._E
        for x in experts:
            e = x if type(x) is int else self._expert(x, layer)
            if e < 0 or e >= E:
                self._expert(e, layer)  # (raises the IndexError)
            key = base + e
            if admit is not None:
                admit(key)
            if pool.capacity - pool.used >= nbytes or self.make_room(pool, nbytes):
                self._insert(key, layer, nbytes, pool, None, False, prec, True)
            else:
                streamed += 1
                if events is not None:  # the executor stages its bytes for this call only
                    events.streamed(layer, e, precision)
            handle = clock.demand(nbytes)
            if handle is not None:
                waits.append(handle)
        n = len(experts)
        st = self.stats
        st.streamed[layer] += streamed
        st.bytes_demand[layer] += n * nbytes
        st.count(prec, n * nbytes, n)
        return n

    def evict(self, key):
        self._evict(key)

    def _evict(self, key):
        """:meth:`evict` (a C call from :meth:`make_room`); ``key`` an int (a policy's victim), else a TypeError."""
        k = key
        here = self._here
        if not (0 <= k < self._nkeys and here[k]):  # not in the cache (bounds-safe: no key wraps to another)
            raise KeyError(key)
        layer = k // self._E
        nbytes = self._nbytes[k]
        here[k] = 0
        self._transfer[k] = None
        pool = self._pool_of_layer[layer]
        pool.used -= nbytes
        self.used_bytes -= nbytes
        if pool.native:
            pool.hooks.on_remove(k)
        else:
            pool.on_remove(k)
        if self.events is not None:
            self.events.evicted(k)
        self._evicted_at[k] = self.pass_index
        st = self.stats
        st.evictions[layer] += 1
        st.lifetime_sum += self.pass_index - self._since[k]
        st.lifetime_n += 1
        if self._prefetched[k] and not self._used[k]:
            st.prefetch_wasted[layer] += 1

    def _uncount_prefetches(self):
        """The prefetches of a pass that did not count were not issued: nor used nor wasted later."""
        here = self._here
        prefetched = self._prefetched
        used = self._used
        for key in range(self._nkeys):
            if here[key] and prefetched[key] and not used[key]:
                prefetched[key] = 0

    # ---- end of run and checks ------------------------------------------------------------------
    def finalize(self) -> None:
        """At the end of a run, prefetched experts never used count as wasted."""
        for key in range(self._nkeys):
            if self._here[key] and self._prefetched[key] and not self._used[key]:
                self.stats.prefetch_wasted[key // self._E] += 1
                self._used[key] = 1

    def check_invariants(self) -> None:
        for pool in self.pools:
            assert 0 <= pool.used <= pool.capacity, (pool.used, pool.capacity)
        assert sum(p.used for p in self.pools) == self.used_bytes == sum(e.nbytes for e in self.entries.values())
        for key in range(self._nkeys):
            assert self._here[key] or self._transfer[key] is None, key  # no handle outlives its entry
        st = self.stats
        for l in range(self.geom.num_layers):
            assert st.hits[l] + st.misses[l] == st.requests[l]
