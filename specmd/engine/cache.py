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
  (What the cache holds, and inserting and evicting: :mod:`specmd.engine.residency`; the layer call a miss
  outcome touches: :mod:`specmd.engine.call`.)
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

from typing import Optional

from .call import LayerCall
from .clock import Clock
from .geometry import Geometry
from .outcomes import NATIVE, Fetched
from .residency import Residency
from .stats import PassRecord
from .view import CacheView


MEASURES = ("all", "decode")  # the forward passes the cache counters count


def _total(counts) -> int:
    """``sum(counts)`` of a per-layer counter, in C (a pass's start and end totals)."""
    t = 0
    for i in range(len(counts)):
        t += counts[i]
    return t


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
            e = x if type(x) is int else self._expert(x, layer)
            if e < 0 or e >= E:
                self._expert(e, layer)  # (raises the IndexError)
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
            e = x if type(x) is int else self._expert(x, layer)
            if e < 0 or e >= E:
                self._expert(e, layer)  # (raises the IndexError)
            key = base + e
            if not here[key]:
                if missing is None:
                    missing = []
                missing.append(e)
                continue
            if prec[key] != native:
                call.plan().run_at(e, self._precs[prec[key]])
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
            e = x if type(x) is int else self._expert(x, layer)
            if e < 0 or e >= E:
                self._expert(e, layer)  # (raises the IndexError)
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
                call.plan().run_at(e, prec)
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
