"""The cache manager: which experts are resident on the emulated device, what a layer call costs.

Model-agnostic: it sees MoE-layer ordinals, expert indices and byte sizes (a :class:`Geometry`), and is
driven by the hook through ``begin_pass`` / ``serve`` / ``prefetch`` / ``finish_layer`` / ``end_pass``.

Semantics (documented in README "Cache semantics"):
* Requests of a layer call are the union of the experts its tokens selected, served in ascending expert
  index. A request is a *hit* if the expert is resident and its bytes have arrived when the layer runs.
* A request for a prefetch still queued or in flight is a *miss* counted as ``prefetch_late``: no new bytes
  move, compute stalls for the remainder (a queued prefetch is promoted to demand priority).
* A *collision miss* is a miss on an expert evicted earlier in the same forward pass (SpecMD §4.2).
* Capacity is a byte budget per pool (one global pool, or one per MoE layer). Prefetches reserve their
  space when issued. The experts of the running layer and prefetches still in flight are never evicted.
* If a demand miss finds no evictable space (the layer's own working set fills its pool), the expert is
  *streamed*: its bytes are transferred, it runs, and it is not inserted. The pool never exceeds capacity.
* A prefetch that finds no evictable space is skipped (``prefetch_skipped``); no bytes move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..clock import SimClock, Transfer
from ..policies.eviction.base import EvictionPolicy, KeySpace
from ..policies.miss.base import DROP, FETCH, HOST, SUBSTITUTE, MissPolicy
from ..quant.base import NATIVE, ExpertStore
from .stats import CacheStats, PassRecord


@dataclass
class Geometry:
    """What the cache and clock need to know about a model."""

    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    expert_bytes: int  # one routed expert at the storage dtype
    total_bytes: int  # the whole model at its storage dtype
    hidden_size: int = 0
    # Roofline inputs (params counted in elements; bytes = params * dtype_bytes):
    dtype_bytes: int = 2
    dense_params: list = field(default_factory=list)  # non-routed params run before MoE layer l (per ordinal)
    attn_layers: list = field(default_factory=list)  # decoder layers covered by segment l (attention count)
    tail_params: int = 0  # params after the last MoE layer (final norm, lm head, trailing dense layers)
    tail_attn_layers: int = 0
    expert_params: int = 0
    layer_ids: list = field(default_factory=list)  # model layer index of each MoE ordinal


class Pool:
    __slots__ = ("capacity", "used", "policy")

    def __init__(self, capacity: int, policy: EvictionPolicy):
        self.capacity = capacity
        self.used = 0
        self.policy = policy


class Entry:
    __slots__ = ("key", "layer", "nbytes", "pool", "transfer", "prefetched", "used", "precision", "bits", "since")

    def __init__(self, key, layer, nbytes, pool, transfer, prefetched, precision=NATIVE, bits=16, since=0):
        self.key = key
        self.layer = layer
        self.nbytes = nbytes
        self.pool = pool
        self.transfer: Optional[Transfer] = transfer
        self.prefetched = prefetched
        self.used = False
        self.precision = precision  # the stored precision this resident copy has
        self.bits = bits
        self.since = since  # forward pass it was inserted in (cache lifetime)


class Served:
    """What a layer call must do differently from "run every requested expert at full precision"."""

    __slots__ = ("dropped", "substitutes", "precisions", "host")

    def __init__(self):
        self.dropped: list[int] = []
        self.substitutes: dict[int, object] = {}  # expert -> [T] replacement experts
        self.precisions: dict[int, str] = {}  # expert -> non-native precision it runs at
        self.host: list[int] = []  # experts computed on the host


def pool_capacities(geom: Geometry, capacity: float, experts_per_layer: Optional[int], scope: str) -> list[int]:
    """Byte budget of each pool."""
    if experts_per_layer is not None:
        per_layer = experts_per_layer * geom.expert_bytes
        return [per_layer] * geom.num_layers if scope == "per_layer" else [per_layer * geom.num_layers]
    total = int(capacity * geom.total_bytes)
    if scope == "per_layer":
        return [total // geom.num_layers] * geom.num_layers
    return [total]


class CacheManager:
    def __init__(
        self,
        geom: Geometry,
        capacities: list[int],
        make_eviction: Callable[[KeySpace], EvictionPolicy],
        miss: MissPolicy,
        clock: SimClock,
        store: Optional[ExpertStore] = None,
        host_time: Optional[Callable[[int, int], float]] = None,
    ):
        self.geom = geom
        self.keys = KeySpace(geom.num_experts)
        self.store = store or ExpertStore(geom.dtype_bytes * 8, geom.expert_bytes, {})
        self.fetch_precision = getattr(miss, "fetch_precision", NATIVE)
        self.high_bits = self.store.bits_of[self.fetch_precision]  # LHU's "high precision"
        self.host_time = host_time  # (token-expert slots, experts) -> seconds on the host
        self.pools = [Pool(c, make_eviction(self.keys)) for c in capacities]
        self._pool_of_layer = (
            self.pools * geom.num_layers if len(self.pools) == 1 else list(self.pools)
        )
        self.miss = miss
        self.clock = clock
        self.stats = CacheStats(geom.num_layers)
        self.entries: dict[int, Entry] = {}
        self.used_bytes = 0  # over all pools
        self.pinned: set[int] = set()
        self.evicted_this_pass: set[int] = set()
        self.pass_index = -1
        self._pass: Optional[list] = None
        self._evictable = self._is_evictable
        self.predicted: list[Optional[set]] = [None] * geom.num_layers  # prefetch predictions per target layer
        for pool in self.pools:
            pool.policy.attach(self, pool)

    # ---- forward passes -------------------------------------------------------------------------
    def begin_pass(self, kind: str, tokens: int, context: int) -> None:
        self.pass_index += 1
        self.evicted_this_pass.clear()
        for pool in self.pools:
            pool.policy.on_pass_start(self.pass_index)
        s = self.stats
        self._pass = [kind, tokens, context, self.clock.now, self.clock.stall_s,
                      s.total("requests"), s.total("hits"), s.total("misses"), s.total("collision_misses")]

    def end_pass(self) -> None:
        if self._pass is None:
            return
        kind, tokens, context, t0, stall0, r0, h0, m0, c0 = self._pass
        g = self.geom
        self._roofline_dense(g.tail_params, g.tail_attn_layers, tokens, context)
        s = self.stats
        s.passes.append(PassRecord(
            self.pass_index, kind, tokens, self.clock.now - t0, self.clock.stall_s - stall0,
            s.total("requests") - r0, s.total("hits") - h0, s.total("misses") - m0,
            s.total("collision_misses") - c0,
        ))
        self._pass = None

    def _roofline_dense(self, params: int, attn_layers: int, tokens: int, context: int) -> None:
        g = self.geom
        flops = 2.0 * tokens * params + 4.0 * tokens * context * g.hidden_size * attn_layers
        self.clock.compute(flops, params * g.dtype_bytes)

    # ---- one MoE layer call ---------------------------------------------------------------------
    def dense(self, layer: int) -> None:
        """Compute of everything between the previous MoE layer and this layer's experts."""
        if self._pass is not None:
            g = self.geom
            self._roofline_dense(g.dense_params[layer], g.attn_layers[layer], self._pass[1], self._pass[2])

    def serve(self, layer: int, experts: list[int], record=None, cache_view=None) -> Optional[Served]:
        """Make the requested experts of ``layer`` available and advance the clock by the stall.
        Returns ``None`` when every requested expert runs at native precision on the device, else a
        :class:`Served` saying which are dropped, substituted, run at lower precision or on the host."""
        clock = self.clock
        now = clock.now
        channel = clock.channel
        channel.advance(now)
        st = self.stats
        base = layer * self.geom.num_experts
        pinned = self.pinned
        pinned.clear()
        for e in experts:
            pinned.add(base + e)
        pool = self._pool_of_layer[layer]
        policy = pool.policy
        policy.on_layer(layer)
        if policy.wants_scores and record is not None:
            policy.on_scores(layer, record.probs.mean(0).tolist())
        pred = self.predicted[layer]
        if pred is not None:
            st.pred_true[layer] += len(pred.intersection(experts))
            st.pred_predicted[layer] += len(pred)
            st.pred_actual[layer] += len(experts)
            self.predicted[layer] = None
        entries = self.entries
        ready = now
        missing = None
        served = None
        hits = 0
        for e in experts:
            key = base + e
            ent = entries.get(key)
            if ent is None:
                if missing is None:
                    missing = []
                missing.append(e)
                continue
            if ent.precision != NATIVE:
                if served is None:
                    served = Served()
                served.precisions[e] = ent.precision
            tr = ent.transfer
            if tr is not None:
                if tr.ready_at > now:  # prefetch still queued or in flight: late
                    t = channel.promote(tr, now)
                    if t > ready:
                        ready = t
                    st.prefetch_late[layer] += 1
                    st.misses[layer] += 1
                    ent.transfer = None
                    ent.used = True
                    st.prefetch_used[layer] += 1
                    policy.on_access(key)
                    continue
                ent.transfer = None
            if ent.prefetched and not ent.used:
                st.prefetch_used[layer] += 1
            ent.used = True
            hits += 1
            policy.on_access(key)
        st.requests[layer] += len(experts)
        st.hits[layer] += hits
        if missing is not None:
            actions = self.miss.handle(layer, missing, record, cache_view)
            store = self.store
            if actions is not None:
                for e, act in zip(missing, actions):
                    if act.kind == SUBSTITUTE:  # substitutes run in this call: never evict them for a fetch
                        for s in act.substitute.unique().tolist():
                            if s != e:
                                pinned.add(base + s)
            host_slots = 0
            for i, e in enumerate(missing):
                key = base + e
                st.misses[layer] += 1
                if key in self.evicted_this_pass:
                    st.collision_misses[layer] += 1
                act = None if actions is None else actions[i]
                if act is not None and act.kind != FETCH:
                    if served is None:
                        served = Served()
                    if act.kind == DROP:
                        served.dropped.append(e)
                        st.dropped[layer] += 1
                    elif act.kind == SUBSTITUTE:
                        served.substitutes[e] = act.substitute
                        st.substituted[layer] += 1
                    elif act.kind == HOST:
                        served.host.append(e)
                        st.host_computed[layer] += 1
                        host_slots += int((record.index == e).sum())
                    else:
                        raise ValueError(f"unknown miss action {act.kind!r}")
                    continue
                prec = self.fetch_precision if act is None or act.precision is None else act.precision
                nbytes = store.bytes_of[prec]
                policy.on_admit(key)
                if self._make_room(pool, nbytes):
                    self._insert(key, layer, nbytes, pool, None, False, prec)
                    entries[key].used = True
                else:
                    st.streamed[layer] += 1
                t = channel.demand(now, nbytes)
                st.bytes_demand[layer] += nbytes
                st.count_precision(prec, nbytes)
                if prec != NATIVE:
                    if served is None:
                        served = Served()
                    served.precisions[e] = prec
                if t > ready:
                    ready = t
            if host_slots:
                t = now + self.host_time(host_slots, len(served.host))
                if t > ready:
                    ready = t
        st.stall_s[layer] += clock.wait_until(ready)
        return served

    def compute_experts(self, layer: int, slots: int, experts: int) -> None:
        """Roofline time of the layer's routed experts: ``slots`` token-expert pairs over ``experts``."""
        g = self.geom
        self.clock.compute(2.0 * slots * g.expert_params, experts * g.expert_bytes)

    def finish_layer(self) -> None:
        self.pinned.clear()

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Queue asynchronous fetches of ``experts`` of MoE layer ``layer`` at the current time (at the
        miss policy's fetch precision). The prediction is remembered for precision/recall."""
        base = layer * self.geom.num_experts
        pool = self._pool_of_layer[layer]
        prec = self.fetch_precision
        nbytes = self.store.bytes_of[prec]
        st = self.stats
        now = self.clock.now
        pred = self.predicted[layer]
        if pred is None:
            self.predicted[layer] = set(experts)
        else:
            pred.update(experts)
        for e in experts:
            key = base + e
            if key in self.entries:
                continue
            pool.policy.on_admit(key)
            if not self._make_room(pool, nbytes):
                st.prefetch_skipped[layer] += 1
                continue
            tr = Transfer(nbytes, now)
            self.clock.channel.submit(tr)
            self._insert(key, layer, nbytes, pool, tr, True, prec)
            st.prefetch_issued[layer] += 1
            st.bytes_prefetch[layer] += nbytes
            st.count_precision(prec, nbytes, fetched=False)

    # ---- internals --------------------------------------------------------------------------------
    def _is_evictable(self, key: int) -> bool:
        if key in self.pinned:
            return False
        tr = self.entries[key].transfer
        return tr is None or tr.ready_at <= self.clock.now

    def _make_room(self, pool: Pool, nbytes: int) -> bool:
        if nbytes > pool.capacity:
            return False
        while pool.capacity - pool.used < nbytes:
            victim = pool.policy.victim(self._evictable)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _insert(self, key, layer, nbytes, pool, transfer, prefetched, precision=NATIVE) -> None:
        self.entries[key] = Entry(key, layer, nbytes, pool, transfer, prefetched, precision,
                                  self.store.bits_of[precision], self.pass_index)
        pool.used += nbytes
        self.used_bytes += nbytes
        pool.policy.on_insert(key, prefetched)
        if self.used_bytes > self.stats.peak_bytes:
            self.stats.peak_bytes = self.used_bytes

    def _evict(self, key: int) -> None:
        ent = self.entries.pop(key)
        ent.pool.used -= ent.nbytes
        self.used_bytes -= ent.nbytes
        ent.pool.policy.on_remove(key)
        self.evicted_this_pass.add(key)
        self.stats.evictions[ent.layer] += 1
        self.stats.lifetime_sum += self.pass_index - ent.since
        self.stats.lifetime_n += 1
        if ent.prefetched and not ent.used:
            self.stats.prefetch_wasted[ent.layer] += 1

    # ---- views and checks ---------------------------------------------------------------------------
    def present(self, layer: int) -> list[int]:
        """Experts of ``layer`` in the cache, arrived or still in flight (what cache-aware routing sees)."""
        base = layer * self.geom.num_experts
        entries = self.entries
        return [e for e in range(self.geom.num_experts) if base + e in entries]

    def resident(self, layer: int) -> list[int]:
        """Experts of ``layer`` whose bytes are on the device now (cache-aware routing reads this)."""
        base = layer * self.geom.num_experts
        now = self.clock.now
        out = []
        for e in range(self.geom.num_experts):
            ent = self.entries.get(base + e)
            if ent is not None and (ent.transfer is None or ent.transfer.ready_at <= now):
                out.append(e)
        return out

    def finalize(self) -> None:
        """At the end of a run, prefetched experts never used count as wasted."""
        for ent in self.entries.values():
            if ent.prefetched and not ent.used:
                self.stats.prefetch_wasted[ent.layer] += 1
                ent.used = True

    def check_invariants(self) -> None:
        for pool in self.pools:
            assert 0 <= pool.used <= pool.capacity, (pool.used, pool.capacity)
        assert sum(p.used for p in self.pools) == self.used_bytes == sum(e.nbytes for e in self.entries.values())
        st = self.stats
        for l in range(self.geom.num_layers):
            assert st.hits[l] + st.misses[l] == st.requests[l]
