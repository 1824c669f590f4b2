# cython: wraparound=False
# (every index in this module is non-negative: a key, a layer, an expert, each checked where it enters)
"""The cache manager: which experts are resident on the emulated device, and the accounting of every
request. It decides residency only; time comes from the clock, victims from the eviction policy (which
sees a read-only :class:`~specmd.engine.view.CacheView`, never this class), what a miss becomes from the
miss policy's outcomes (:mod:`specmd.engine.outcomes`).

Semantics (docs/semantics.md "Cache semantics"):
* Requests of a layer call are the union of the experts its tokens selected. The call serves its hits
  first (ascending expert index), then its misses (ascending, through the miss policy's outcomes).
* A request is a *hit* if the expert is resident and its bytes have arrived when the layer runs. A request
  for a prefetch still queued or in flight is a *miss* counted as ``prefetch_late``: no new bytes move,
  compute stalls for the remainder (a queued prefetch is promoted to demand priority).
* A *collision miss* is a miss on an expert evicted earlier in the same forward pass (SpecMD §4.2).
* Capacity is a byte budget per pool (one global pool, or one per MoE layer). Prefetches reserve their
  space when issued. The experts of the running layer and prefetches still in flight are never evicted.
* If a demand miss finds no evictable space (the layer's own working set fills its pool), the expert is
  *streamed*: its bytes are transferred, it runs, and it is not inserted. The pool never exceeds capacity.
* A prefetch that finds no evictable space is skipped (``prefetch_skipped``); no bytes move.
* *Layer streaming* (``hardware.stream_layers``; docs/semantics.md "Layer streaming"): a call that requests
  at least ``stream_at`` of its layer's experts is *streamed*: its hits are served as always, its misses
  (counted as misses, and ``stream_served``) come through a staging area outside the pools (bytes moved,
  nothing inserted or evicted, the miss policy not asked: every requested expert runs exactly, at the
  fetch precision), and the next layer is *staged ahead*: every expert it lacks starts moving as this
  call's experts start computing, and its call is streamed whatever it requests.
"""

from __future__ import annotations

import operator
from array import array
from collections import namedtuple
from typing import Optional

from .clock import Clock
from .geometry import Geometry
from .hooks import Evictable, compiled_hooks
from .outcomes import NATIVE, Execution, Fetched
from .residency import PoolLayout
from .stats import CacheStats, PassRecord
from .store import StoreSizes
from .view import CacheView


MEASURES = ("all", "decode")  # the forward passes the cache counters count


def _total(counts) -> int:
    """``sum(counts)`` of a per-layer counter, in C (a pass's start and end totals)."""
    t = 0
    for i in range(len(counts)):
        t += counts[i]
    return t


def _expert(x, layer: int, E: int) -> int:
    """``x`` as an expert index of ``layer``, checked: the one gate of the request path's unchecked array
    reads. An integer (numpy's too) in ``0 .. E - 1``; anything else is an IndexError or, a float, a
    TypeError (compiled, never truncated to a key). The request path's loops make the common case's check
    inline (``type(x) is int and 0 <= x < E``: no call per request) and call this for any other."""
    if not isinstance(x, int):
        x = operator.index(x)
    e = x
    if e < 0 or e >= E:
        raise IndexError(f"expert {e} of layer {layer}: the model has {E} experts per layer")
    return e


class Pool:
    """A byte budget and its eviction policy. (Fields: ``cache.pxd``.)"""

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


class LayerCall:
    """The state of the layer call being served: what an outcome may touch (one object, reused)."""


    def __init__(self, manager):
        self._m = manager
        self.fetch_precision = manager.fetch_precision
        self.waits: list = []  # the clock's handles the device's experts wait for (demand fetches, late prefetches;
        # host work where the host shares the device's cores: CacheManager._stall)
        self.host_handle = None  # the host's work this call (the layer's output waits for it: finish_layer)
        self.demanded = 0  # demand fetches issued (the clock may return no handle for them)

    def reset(self, layer: int, base: int, pool: Pool, record, index, weights, n: int):
        """A new layer call; ``base``: its layer's first key (``layer * num_experts``, computed by the caller)."""
        self.layer = layer
        self.base = base
        self.pool = pool
        self.record = record
        if self.waits:  # (list.clear is a method call from C: skipped when there is nothing to clear)
            self.waits.clear()
        self.execution = None
        self.host_slots = 0
        self.host_experts = 0
        self.host_handle = None
        self.demanded = 0
        self.index = index
        self.weights = weights
        self.n = n

    # -- what outcomes use ------------------------------------------------------------------------
    def plan(self) -> Execution:
        """The layer's execution plan, created on first use (the lossless path never needs one)."""
        ex = self.execution
        if ex is None:
            import torch

            index, weights = self.index, self.weights
            if index is None:  # the record's own selection
                index, weights = self.record.index, self.record.weights
            # slots a routing policy declared empty (prune: Routed.void)
            void = self.record.void if self.record is not None and self.record.rerouted else None
            slots = index.numel() - (0 if void is None else int(void.sum()))
            ex = self.execution = Execution(index, weights, torch.ones_like(index, dtype=torch.bool), slots, self.n,
                                            void, self._m.geom.num_experts)
        return ex

    def pin(self, expert: int) -> None:
        self._m.pin(self.base + expert)

    def count(self, stat: str) -> None:
        self._m.stats.add(stat, self.layer)

    def fetch(self, expert: int, precision: str) -> None:
        """A blocking transfer of ``expert`` at ``precision``: inserted if room can be made, else streamed."""
        self.fetch_many((expert,), precision)

    def fetch_many(self, experts, precision):
        """:meth:`fetch` for each of ``experts`` in order (one home for the demand-fetch accounting)."""
        m = self._m
        nbytes = m._bytes_of[precision]
        prec = m._prec_id[precision]
        pool = self.pool
        base = self.base
        layer = self.layer
        streamed = 0
        clock = m.clock
        admit = pool.on_admit
        waits = self.waits
        events = m.events
        E = m._E
        for x in experts:
            e = x if type(x) is int else _expert(x, layer, E)
            if e < 0 or e >= E:
                _expert(e, layer, E)  # (raises the IndexError)
            key = base + e
            if admit is not None:
                admit(key)
            if pool.capacity - pool.used >= nbytes or m.make_room(pool, nbytes):
                m._insert(key, layer, nbytes, pool, None, False, prec, True)
            else:
                streamed += 1
                if events is not None:  # the executor stages its bytes for this call only
                    events.streamed(layer, e, precision)
            handle = clock.demand(nbytes)
            if handle is not None:
                waits.append(handle)
        n = len(experts)
        self.demanded += n
        st = m.stats
        st.streamed[layer] += streamed
        st.bytes_demand[layer] += n * nbytes
        st.count(prec, n * nbytes, n)

    def host(self, slots: int) -> None:
        """Host compute of one expert's ``slots`` token-expert pairs (timed once per call, in ``finish``)."""
        self.host_slots += slots
        self.host_experts += 1


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
    to insert is :class:`CacheManager`'s. (Fields: ``cache.pxd``.)"""

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
        # who materialises residency (a :class:`~specmd.engine.residency.ResidencyEvents`: ``subscribe``), or
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

    # ---- the executor's seam (specmd.engine.residency) -----------------------------------------------
    def layout(self) -> PoolLayout:
        """The pools as an executor needs them: capacities in bytes, and each MoE layer's pool."""
        return PoolLayout(tuple(self.ceilings),
                          tuple(self.pools.index(p) for p in self._pool_of_layer), int(self._E))

    def subscribe(self, events) -> None:
        """``events`` (a :class:`~specmd.engine.residency.ResidencyEvents`) carries out every residency change
        from now on: one subscriber per manager, before any request (it must see every insert)."""
        if self.events is not None and self.events is not events:
            raise RuntimeError("the cache manager already has a residency subscriber (one executor per engine)")
        if self.used_bytes:
            raise RuntimeError("subscribe before the first request: the subscriber would miss resident copies")
        self.events = events

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


class CacheManager(Residency):
    """Serves every request: each MoE layer call's hits, misses (the miss policy's outcomes), streaming and
    stall, prefetches, and the forward passes' accounting, over the :class:`Residency` it extends.
    (Fields: ``cache.pxd``.)"""

    def __init__(self, geom: Geometry, capacities: list[int], evictions: list, miss, clock: Clock, store=None,
                 measure: str = "all", stream_at: int = 0):
        """``evictions``, ``store``: :class:`Residency`'s; ``measure``: which passes the counters keep (``all``,
        or ``decode``: a prefill pass runs and warms the cache, then its counts are rolled back; its pass record
        stays for the timing section); ``stream_at``: the requested experts at which a layer call is streamed
        (0: never; module docstring)."""
        Residency.__init__(self, geom, capacities, evictions, clock, store)
        self.miss = miss
        self._miss_passive = miss.passive()
        self.fetch_precision = getattr(miss, "fetch_precision", NATIVE)
        self._fetch_native = self.fetch_precision == NATIVE
        if measure not in MEASURES:
            raise ValueError(f"measure={measure!r}; valid: {', '.join(MEASURES)}")
        self.measure = measure
        self._uncounted: Optional[dict] = None  # the counters before a pass that does not count
        # the ongoing forward pass: [kind, tokens, context, then its start figures], None outside one
        self.current_pass: Optional[list] = None
        self.predicted: list[Optional[set]] = [None] * geom.num_layers  # prefetch predictions per target layer
        self._call = LayerCall(self)
        self.view = CacheView(self)
        self._default_fetch = Fetched(None)
        self.streaming = LayerStreaming(self, stream_at)
        for pool in self.pools:
            pool.policy.attach(self.view, pool.capacity)




    # ---- forward passes -------------------------------------------------------------------------
    def begin_pass(self, kind, tokens, context):
        self.pass_index += 1
        for pool in self.pools:
            if pool.on_pass_start is not None:
                pool.on_pass_start(self.pass_index)
        s = self.stats
        if self.measure != "all" and kind != self.measure:
            self._uncounted = s.snapshot()
        self.streaming.drop()  # (a pass never inherits a stage: every pass runs every layer)
        self.current_pass = [kind, tokens, context, self.clock.mark(),
                             _total(s.requests), _total(s.hits), _total(s.misses), _total(s.collision_misses),
                             self._moved()]

    def end_pass(self):
        if self.current_pass is None:
            return
        kind, tokens, context, mark, r0, h0, m0, c0, b0 = self.current_pass
        clock = self.clock
        clock.tail(tokens, context)
        s = self.stats
        seconds, stall = clock.since(mark)
        s.passes.append(PassRecord(
            self.pass_index, kind, tokens, seconds, stall,
            _total(s.requests) - r0, _total(s.hits) - h0, _total(s.misses) - m0, _total(s.collision_misses) - c0,
            self._capacity(), self.kv_bytes, self._moved() - b0,
        ))
        self.current_pass = None
        if self._uncounted is not None:
            s.restore(self._uncounted)
            self._uncounted = None
            self._uncount_prefetches()


    def _moved(self) -> int:
        """Bytes moved so far: demand fetches, prefetches and layer streams (every layer's)."""
        s = self.stats
        return _total(s.bytes_demand) + _total(s.bytes_prefetch) + _total(s.bytes_stream)

    def _capacity(self) -> int:
        """The pools' capacities summed (bytes)."""
        t = 0
        for pool in self.pools:
            t += pool.capacity
        return t

    # ---- one MoE layer call: named steps --------------------------------------------------------
    def serve(self, layer: int, experts, record=None, index=None, weights=None) -> LayerCall:
        """Make the requested ``experts`` of ``layer`` available and stall until they are. Returns the
        call; ``call.execution`` is None when every requested expert runs at native precision on the
        device (the lossless fast path), else the plan the outcomes built. ``index``/``weights`` are the
        selection the layer runs (None: the record's, read only if an outcome needs it)."""
        call = self._open(layer, experts, record, index, weights)
        streaming = self.streaming
        if streaming.at and (layer == streaming.layer or len(experts) >= streaming.at):
            streaming.serve(call, experts)
        else:
            missing = self._serve_hits(call, experts)
            if missing:
                self._serve_misses(call, missing)
        self._stall(call)
        return call

    def _open(self, layer: int, experts, record, index, weights) -> LayerCall:
        """Step 1: pin the requests, tell the pool's policy where execution is, score the prediction.
        Every requested expert is checked to be one of the layer's (the later steps index by it unchecked)."""
        self.clock.begin_layer()
        self._stamp += 1
        stamp = self._stamp
        pin = self._pin
        E = self._E
        if layer < 0 or layer >= len(self._pool_of_layer):
            raise IndexError(f"MoE layer {layer} of {len(self._pool_of_layer)}")
        base = layer * E
        for x in experts:
            e = x if type(x) is int else _expert(x, layer, E)
            if e < 0 or e >= E:
                _expert(e, layer, E)  # (raises the IndexError)
            pin[base + e] = stamp
        pool = self._pool_of_layer[layer]
        if pool.on_layer is not None:
            pool.on_layer(layer, record)
        pred = self.predicted[layer]
        if pred is not None:
            st = self.stats
            st.pred_true[layer] += len(pred.intersection(experts))
            st.pred_predicted[layer] += len(pred)
            st.pred_actual[layer] += len(experts)
            self.predicted[layer] = None
        call = self._call
        call.reset(layer, base, pool, record, index, weights, len(experts))
        return call

    def _serve_hits(self, call: LayerCall, experts):
        """Step 2: resident experts (hits, late prefetches); returns the missing ones."""
        here = self._here
        prec = self._prec
        used = self._used
        prefetched = self._prefetched
        transfers = self._transfer
        native = self._native
        st = self.stats
        layer = call.layer
        base = call.base
        hits = 0
        pool = call.pool
        # the pool's policy's on_access: in C when it compiles it, else its bound Python method
        compiled = pool.native
        hooks = pool.hooks
        on_access = pool.on_access
        clock = self.clock
        missing = None
        E = self._E
        for x in experts:
            # (checked by _open; again, as policy code ran since and may change the list)
            e = x if type(x) is int else _expert(x, layer, E)
            if e < 0 or e >= E:
                _expert(e, layer, E)  # (raises the IndexError)
            key = base + e
            if not here[key]:
                if missing is None:
                    missing = []
                missing.append(e)
                continue
            if prec[key] != native:
                call.plan().precisions[e] = self._precs[prec[key]]
            tr = transfers[key]
            if tr is not None:
                transfers[key] = None
                if not clock.done(tr):  # prefetch still queued or in flight: late
                    call.waits.append(clock.promote(tr))
                    st.prefetch_late[layer] += 1
                    st.misses[layer] += 1
                    used[key] = 1
                    if prefetched[key]:  # not a prefetch of a pass that did not count (measure=decode)
                        st.prefetch_used[layer] += 1
                    if compiled:
                        hooks.on_access(key)
                    else:
                        on_access(key)
                    continue
            if prefetched[key] and not used[key]:
                st.prefetch_used[layer] += 1
            used[key] = 1
            hits += 1
            if compiled:
                hooks.on_access(key)
            else:
                on_access(key)
        st.requests[layer] += len(experts)
        st.hits[layer] += hits
        return missing

    def _serve_misses(self, call: LayerCall, missing):
        """Step 3: the miss policy names an outcome per missing expert; each outcome serves itself."""
        layer = call.layer
        self._count_misses(call, missing)
        # (a passive miss policy's handle always answers None: not called)
        outcomes = None if self._miss_passive else self.miss.handle(layer, missing, call.record, self.view)
        if outcomes is None:  # every miss fetched at the policy's precision (what Fetched(None) does)
            if self._fetch_native:
                call.fetch_many(missing, NATIVE)
                return
            outcomes = [self._default_fetch] * len(missing)
        for e, out in zip(missing, outcomes):
            out.prepare(call, e)
        for e, out in zip(missing, outcomes):
            out.serve(call, e)

    def _count_misses(self, call: LayerCall, missing) -> None:
        """A call's misses counted (collision misses among them: evicted earlier in this pass) and told to the
        pool's policy (``on_miss``), before any policy code runs: the list is still the one ``_open`` checked."""
        layer = call.layer
        base = call.base
        st = self.stats
        evicted_at = self._evicted_at
        now = self.pass_index
        st.misses[layer] += len(missing)
        collisions = 0
        for e in missing:
            if evicted_at[base + e] == now:
                collisions += 1
        st.collision_misses[layer] += collisions
        on_miss = call.pool.on_miss
        if on_miss is not None:
            for x in missing:
                on_miss(base + x)

    def _stall(self, call: LayerCall):
        """Step 4: the host's work is issued: it runs beside the transfers, and beside the device's compute
        when the host is a processor of its own (:meth:`Clock.host_beside_device`: the output waits for it in
        :meth:`finish_layer`); else the device's experts wait for it as for their transfers."""
        clock = self.clock
        if call.host_experts:
            h = clock.host(call.host_slots, call.host_experts)
            if clock.host_beside_device():
                call.host_handle = h
            else:
                call.waits.append(h)
        if call.waits or call.demanded:  # (a clock may track demand fetches without handles: Clock.demand)
            self.stats.stall_s[call.layer] += self.clock.wait(call.waits)

    def finish_layer(self):
        """The layer call's experts have been charged: its output waits for the host's share (if it is
        later than the device's), and the call's experts are unpinned."""
        call = self._call
        h = call.host_handle
        if h is not None:
            call.host_handle = None
            self.stats.stall_s[call.layer] += self.clock.wait((h,))
        self._stamp += 1  # unpins the call's experts

    def prefetch(self, layer: int, experts: list) -> None:  # (not list[int]: compiled, that truncates floats)
        """Queue asynchronous fetches of ``experts`` of MoE layer ``layer`` now (at the miss policy's
        fetch precision). The prediction is remembered for precision/recall."""
        if not 0 <= layer < len(self._pool_of_layer):
            raise IndexError(f"prefetch for MoE layer {layer} of {len(self._pool_of_layer)}")
        E = self._E
        base = layer * E
        pool = self._pool_of_layer[layer]
        prec = self.fetch_precision
        nbytes = self._bytes_of[prec]
        pid = self._prec_id[prec]
        st = self.stats
        pred = self.predicted[layer]
        if pred is None:
            self.predicted[layer] = set(experts)
        else:
            pred.update(experts)
        for x in experts:
            e = x if type(x) is int else _expert(x, layer, E)
            if e < 0 or e >= E:
                _expert(e, layer, E)  # (raises the IndexError)
            key = base + e
            if self.has(key):
                continue
            if pool.on_admit is not None:
                pool.on_admit(key)
            if not self.make_room(pool, nbytes):
                st.prefetch_skipped[layer] += 1
                continue
            self._insert(key, layer, nbytes, pool, self.clock.prefetch(nbytes), True, pid, False)
            st.prefetch_issued[layer] += 1
            st.bytes_prefetch[layer] += nbytes
            st.count(pid, nbytes, 0)


class LayerStreaming:
    """Layer streaming (module docstring): a call of at least ``at`` requested experts (0: never) takes its
    misses from a staging area, for this call only, and stages the next layer's ahead. The manager's part
    for it, beside :class:`CacheManager` (which serves every other call). (Fields: ``cache.pxd``.)"""

    def __init__(self, manager, at: int):
        if isinstance(at, bool) or not isinstance(at, int) or at < 0:
            raise ValueError(f"stream_at={at!r}: a whole number of experts >= 0 (0: no layer streaming)")
        self._m = manager
        self.at = at
        # the layer staged ahead (-1: none), the experts it lacked then, the clock's handle of their transfer;
        # ``ahead``: the call being served stages the next layer
        self.layer = -1
        self.experts = None
        self.handle = None
        self.ahead = False

    def drop(self) -> None:
        """No layer staged any more (taken by its call, or a new pass)."""
        self.layer = -1
        self.experts = self.handle = None

    def serve(self, call: LayerCall, experts):
        """Steps 2-3 of a streamed call (module docstring): hits as always; the misses from the staging area,
        what was staged ahead waited for, the rest moved now as one copy job. Nothing enters or leaves a pool."""
        m = self._m
        layer = call.layer
        st = m.stats
        st.layer_streams[layer] += 1
        self.ahead = len(experts) >= self.at  # (a staged call below the threshold ends the run ahead)
        missing = m._serve_hits(call, experts)
        staged = None
        stage = None
        if layer == self.layer:
            staged = self.experts
            stage = self.handle
            self.drop()
        if not missing:
            return  # (every request a hit: the stage's bytes are not waited for)
        st.stream_served[layer] += len(missing)
        m._count_misses(call, missing)
        prec = m.fetch_precision
        late = 0  # misses the stage ahead did not carry (none, or a layer not staged): moved now
        needs_stage = False
        for e in missing:
            if staged is None or e not in staged:
                late += 1
            else:
                needs_stage = True
        if needs_stage and stage is not None and not m.clock.done(stage):  # only for a miss it carries
            call.waits.append(m.clock.promote(stage))
        if late:
            nbytes = late * m._bytes_of[prec]
            handle = m.clock.demand(nbytes, late)  # (each into a staging row)
            if handle is not None:
                call.waits.append(handle)
            call.demanded += late
            st.bytes_stream[layer] += nbytes
            st.count(m._prec_id[prec], nbytes, 0)
        native = prec == NATIVE
        events = m.events
        for e in missing:
            if not native:
                call.plan().precisions[e] = prec
            if events is not None:  # the executor stages its bytes for this call only
                events.streamed(layer, e, prec)

    def stage_ahead(self) -> None:
        """After a streamed call that reached the threshold, as its experts start computing: the next MoE
        layer's experts not in the cache start moving into the staging area's other buffer (one copy job,
        queued on the link behind demand: it overlaps this layer's compute), and that layer's call is
        streamed. The routing of the next layer is not known yet, so the stage carries every expert it lacks."""
        if not self.ahead:
            return
        self.ahead = False
        m = self._m
        layer = m._call.layer + 1
        if layer >= len(m._pool_of_layer):
            return
        E = m._E
        base = layer * E
        here = m._here
        staged = set()
        for e in range(E):
            if not here[base + e]:
                staged.add(e)
        prec = m.fetch_precision
        nbytes = len(staged) * m._bytes_of[prec]
        st = m.stats
        st.bytes_stream[layer] += nbytes
        st.count(m._prec_id[prec], nbytes, 0)
        self.layer = layer
        self.experts = staged
        # (every staged expert placed now, as this clock stages them ahead; the offload executor stages a
        # streamed call's misses at the call -- docs/semantics.md "Layer streaming" -- so with streaming on the
        # per-placement cost counts the staged layer, not only the call's misses)
        self.handle = m.clock.prefetch(nbytes, len(staged)) if nbytes else None
