"""The engine: cache manager + clock + the four policy families, driven by a stream of gate records.

Two drivers feed it the same calls in the same order: the live hook on a transformers model
(:mod:`specmd.hook.stack`) and the trace replay (:mod:`specmd.replay.driver`)::

    engine.begin_pass(kind, tokens, context)
    for each MoE layer call:  engine.route(record)   # routing policy (the live hook returns its result to the model)
                              plan = engine.layer(record)   # serve, prefetch, compute; None = run as routed
    engine.end_pass()

Nothing in the engine imports a model, and no policy knows which driver feeds it: policies see a
:class:`ModelView` (geometry, stored precisions, the future when a trace provides it) and the cache's
read-only :class:`~specmd.engine.view.CacheView`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import ConfigError
from .cache import CacheManager
from .clock import Clock
from .simclock import SimClock
from .geometry import Geometry, pool_capacities, timed_as
from .budget import WARMUP, LayerBudget
from .memory import GIB, DeviceMemory, KvLayout
from .outcomes import Execution
from .record import expert_counts
from .store import StoreSizes
from .union import union_section

GROUPS = ("routing", "miss", "eviction", "prefetch")


@dataclass
class StackSpec:
    """One policy stack and emulated device, as data: each family as (class, validated params), the
    hardware, and the quantization method (class, params) or None (native experts only). The composition
    root builds it from config (:func:`specmd.compose.stack_spec`, :func:`specmd.compose.spec_of`): the
    engine never looks a name up in a registry."""

    routing: tuple
    miss: tuple
    eviction: tuple
    prefetch: tuple
    hardware: Any
    quant: Optional[tuple] = None
    measure: str = "all"  # the passes the cache section counts: all | decode (docs/policies.md "Prefill and decode")
    timing: Optional[tuple] = None  # (name, Geometry): a real model's sizes and compute (hardware.timing_as)
    execution: Optional[tuple] = None  # (Executor class, params): who carries the decisions out (live runs)

    def build(self, family: str):
        cls, params = getattr(self, family)
        return cls(params)

    def names(self) -> dict:
        return {g: getattr(self, g)[0].name for g in GROUPS}


class ModelView:
    """What policies may know about the model: geometry, stored precisions (``store``) and, when a trace
    provides it, the future (``future``: see :class:`specmd.replay.future.Future`; None in a live run)."""

    def __init__(self, geom: Geometry, store, future=None):
        self.geometry = geom
        self.num_layers = geom.num_layers
        self.num_experts = geom.num_experts
        self.top_k = geom.top_k
        self.layer_ids = list(geom.layer_ids)
        self.store = store
        self.future = future

    def next_layer(self, layer: int) -> Optional[int]:
        return layer + 1 if layer + 1 < self.num_layers else None


def check_model_ranges(spec: StackSpec, model: Geometry) -> None:
    """Settings whose valid range depends on the model, checked as soon as its geometry is known (before any
    forward pass): every policy's top-J (Cache-Conditional Experts' and Skliar et al.'s J: ranks always
    kept, 0..k) and the cache's slots per layer (at most the layer's experts)."""
    if not (model.num_layers >= 1 and model.num_experts >= 1 and 1 <= model.top_k <= model.num_experts
            and model.expert_bytes >= 1):
        raise ConfigError(f"the model's geometry holds nothing to cache: {model.num_layers} MoE layers, "
                          f"{model.num_experts} experts of {model.expert_bytes} bytes, top-{model.top_k}")
    errors = []
    for group in GROUPS:
        cls, params = getattr(spec, group)
        j = getattr(params, "J", None)
        if j is not None and not 0 <= j <= model.top_k:
            errors.append(f"{group}.J={j} must be in 0..{model.top_k} (the model's top-k; {group}={cls.name})")
        model_errors = getattr(cls, "model_errors", None)  # a policy's own model-bounded settings
        if model_errors is not None and params is not None:
            errors += [f"{group}={cls.name}: {e}" for e in model_errors(params, model)]
    epl = spec.hardware.experts_per_layer
    if epl is not None and epl > model.num_experts:
        errors.append(f"hardware.experts_per_layer={epl:g} exceeds the model's {model.num_experts} experts per layer")
    if errors:
        raise ConfigError("; ".join(errors))


def check_capacity(caps: list, hw: Any, geom: Geometry, store: StoreSizes, fetched: list) -> None:
    """Every pool holds at least one expert at the smallest precision the stack fetches (``fetched``): a
    smaller budget is a cache that can hold nothing, every request a miss whatever the policies, and almost
    certainly a typo (``capacity=1e-12``) or a capacity meant for a bigger model. The message names the bytes
    of one expert and the smallest capacity that holds one."""
    nbytes, precision = min((store.bytes_of[p], p) for p in fetched)
    smallest = min(caps)
    if smallest >= nbytes:
        return
    per_layer = hw.scope == "per_layer"
    need = nbytes * (geom.num_layers if per_layer else 1) / geom.total_bytes
    e = math.floor(math.log10(need)) - 2  # 3 significant digits, rounded up: the value printed is enough
    need = math.ceil(need / 10 ** e) * 10 ** e
    pool = f"each of the {geom.num_layers} per-layer pools" if per_layer else "the cache"
    raise ConfigError(f"hardware.capacity={hw.capacity:g} gives {pool} {smallest:,} bytes, less than one expert at "
                      f"{precision} precision ({nbytes:,} bytes; the model is {geom.total_bytes:,} bytes): the "
                      f"cache would hold nothing. The smallest capacity that holds one expert is {need:.3g}"
                      f"{' with scope=per_layer' if per_layer else ''}")


def device_memory(geom: Geometry, hw: Any, store: StoreSizes, fetched: list) -> Optional[DeviceMemory]:
    """The :class:`DeviceMemory` of ``hardware.memory_gb`` on ``geom`` (the timing model's, with ``timing_as``),
    or None (a fixed capacity). Its ``ceiling``, each pool's most, is the memory with no KV cache, capped at
    every expert of the pool at the largest stored precision (a cache that holds the whole model). Refused: a
    model whose KV cache specmd cannot size, and dense weights and reserve that leave less than one expert
    of the smallest fetched precision per pool even with no KV cache."""
    mem_gb = getattr(hw, "memory_gb", None)
    if mem_gb is None:
        return None
    kv = KvLayout.from_dict(geom.kv)
    if kv.unknown:
        raise ConfigError(f"hardware.memory_gb={mem_gb:g} needs the model's KV cache per token: {kv.unknown}; use "
                          f"hardware.capacity, or hardware.timing_as=NAME (a real model's sizes and KV cache)")
    pools = geom.num_layers if hw.scope == "per_layer" else 1
    routed = geom.num_layers * geom.num_experts * max(store.bytes_of.values())
    mem = DeviceMemory(int(mem_gb * GIB), int(hw.reserve_gb * GIB),
                       max(0, geom.total_bytes - geom.num_layers * geom.num_experts * geom.expert_bytes), kv, pools)
    left = mem.memory_bytes - mem.reserve_bytes - mem.dense_bytes
    mem.ceiling = min(left, routed) // pools if left > 0 else 0
    nbytes, precision = min((store.bytes_of[p], p) for p in fetched)
    if mem.ceiling < nbytes:
        raise ConfigError(f"hardware.memory_gb={mem_gb:g} leaves {max(left, 0) / GIB:.4g} GiB for experts "
                          f"({mem.describe(())}; {'each of ' + str(pools) + ' per-layer pools ' if pools > 1 else ''}"
                          f"less than one expert at {precision} precision, {nbytes:,} bytes): the cache would hold "
                          f"nothing before any KV cache")
    return mem


def check_memory_fits(spec: StackSpec, model: Geometry) -> None:
    """``hardware.memory_gb`` checked on a model's geometry before any weight loads (a live run's config stage):
    its KV layout is known, and the dense weights, the reserve and one token's KV cache leave at least one
    expert of the stack's fetched precision (the native one: a quantized store is not built yet). The engine
    checks it again when built, and every pass's own KV cache as the pass begins."""
    if getattr(spec.hardware, "memory_gb", None) is None:
        return
    geom = timed_as(model, spec.timing[1])[0] if spec.timing is not None else model
    mem = device_memory(geom, spec.hardware, StoreSizes.native_only(geom), ["native"])
    if mem.excess((1,)) > 0:
        raise ConfigError(f"hardware.memory_gb={spec.hardware.memory_gb:g} cannot hold one token: {mem.describe((1,))}")


def static_slots(cache: CacheManager, memory: Optional[DeviceMemory], fetch_bytes: int):
    """The experts a static cache of the same bytes holds (``cache.union.static_share``): the pools' whole
    experts; with ``hardware.memory_gb``, each counted pass's, weighted by its requests (a pinned set sized per
    pass, as the cache is: the hit rate it gets is its share of the experts at each request)."""
    if memory is None:
        return sum(p.capacity // fetch_bytes for p in cache.pools)
    weighted = total = 0
    for p, (_, _, slots) in zip(cache.stats.passes, memory.series):
        if (cache.measure == "all" or p.kind == cache.measure) and p.requests:
            weighted += slots * p.requests
            total += p.requests
    return weighted / total if total else 0


def stream_at(threshold: Optional[float], num_experts: int) -> int:
    """The requested experts at which a layer call is streamed: ``hardware.stream_layers`` (a fraction of the
    layer's experts, or None: never) as a count, at least 1 (``ceil``, with a rounding guard: 0.3 of 10 is 3)."""
    if threshold is None:
        return 0
    return max(1, math.ceil(threshold * num_experts - 1e-9))


class Engine:
    """(A compiled extension type: ``engine.pxd`` declares its fields and the drivers' per-call methods.)"""

    def __init__(self, geom: Geometry, spec: StackSpec, store=None, future=None, clock: Optional[Clock] = None):
        """``store``: the stored precisions' sizes (:class:`~specmd.engine.store.StoreSizes`; default the
        model's own experts only); ``future``: the trace's future (replay); ``clock``: default the simulated
        clock of ``spec.hardware``."""
        check_model_ranges(spec, geom)  # the routing's own geometry (timing_as may map it to another)
        store = store or StoreSizes.native_only(geom)
        self.timing_as = None
        if spec.timing is not None:  # the routing's layers and experts with a real model's sizes and compute
            self.timing_as, timing = spec.timing
            routing = geom
            geom, f_bytes, _ = timed_as(routing, timing)
            # each precision keeps its bytes per parameter, and a routing expert holds its timing share of
            # parameters: scale by (timing-share parameters) / (routing parameters), both from bytes / dtype
            # (an imported trace has no parameter count, only bytes)
            scale = (geom.expert_bytes / geom.dtype_bytes) / (routing.expert_bytes / routing.dtype_bytes)
            store = store.resized({p: (geom.expert_bytes if p == "native" else round(b * scale))
                                   for p, b in store.bytes_of.items()})
        self.geom = geom
        self.spec = spec
        self.store = store
        self.model = ModelView(geom, self.store, future)
        self.routing = spec.build("routing")
        self.miss = spec.build("miss")
        self.prefetch = spec.build("prefetch")
        for policy in (self.routing, self.miss, self.prefetch):
            policy.setup(self.model)
        hw = spec.hardware
        caps, ceilings = self._pools(geom, hw)
        evictions = [spec.build("eviction") for _ in caps]
        for policy in evictions:
            policy.setup(self.model)
        self.clock = clock or SimClock.from_hardware(geom, hw, spec.names())
        self.cache = CacheManager(geom, caps, evictions, self.miss, self.clock, self.store, spec.measure,
                                  stream_at(getattr(hw, "stream_layers", None), geom.num_experts))
        self.cache.ceilings = ceilings
        self._warming = self.budget is not None
        self._streams = self.cache.streaming.at > 0
        self.view = self.cache.view
        # a passive routing or prefetch policy (its hook always answers "no change": RoutingPolicy.passive) is
        # not called per layer call
        self._routes = not self.routing.passive()
        self._predicts = not self.prefetch.passive()
        self.calls = 0  # layer calls so far (each record's ``call``)
        self.predictions = 0  # prefetch predictions made (one per target layer per call)
        self._E = geom.num_experts
        self._Z = geom.identity_experts  # identity experts: selected, never served, no compute (LongCat-Flash)

    def _pools(self, geom: Geometry, hw) -> tuple:
        """The pools' first capacities and their ceilings (bytes): a fixed capacity's, or the device memory's
        with no KV cache (``hardware.memory_gb``: each pass sets its own, :meth:`begin_pass`); with per-layer
        budgets a pool's ceiling is its layer's every expert (``hardware.layer_budget``)."""
        mcls, mparams = self.spec.miss
        fetched = mcls.required_precisions(mparams) or [self.miss.fetch_precision]
        self.memory = device_memory(geom, hw, self.store, fetched)
        if self.memory is not None:
            caps = [self.memory.ceiling] * self.memory.pools
        elif isinstance(hw.capacity, str):  # (auto: the app resolves it to memory_gb on the device it runs on)
            raise ConfigError(f"hardware.capacity={hw.capacity} is read from the device when a live run installs its "
                              f"stack (execution=offload); here give a fraction, or hardware.memory_gb")
        else:
            caps = pool_capacities(geom, hw.capacity, hw.experts_per_layer, hw.scope)
            check_capacity(caps, hw, geom, self.store, fetched)
        self._fetch_bytes = min(self.store.bytes_of[p] for p in fetched)  # the smallest copy a pool must hold
        self._slot_bytes = self.store.bytes_of[getattr(self.miss, "fetch_precision", "native")]  # a slot's bytes
        self.budget = None  # per-layer budgets (hardware.layer_budget=proportional), measured in the warm-up
        self._total = sum(caps)  # a fixed capacity's bytes, which per-layer budgets share out
        if getattr(hw, "layer_budget", "uniform") != "proportional":
            return caps, list(caps)
        self.budget = LayerBudget(geom.num_layers, geom.num_experts)
        whole = geom.num_experts * max(self.store.bytes_of.values())  # a layer's every expert
        room = self._total if self.memory is None else self.memory.ceiling * self.memory.pools
        return caps, [min(whole, room)] * len(caps)

    # ---- passes ---------------------------------------------------------------------------------
    def begin_pass(self, kind, tokens, context, contexts=None):
        """A forward pass of ``tokens`` live tokens at ``context`` (:func:`~specmd.engine.batch.batched_context`);
        ``contexts``: each live sequence's own context (its tokens before and in this pass), what its KV cache
        holds (``hardware.memory_gb``; None: one sequence of ``context``)."""
        mem = self.memory
        resplit = False
        if self._warming and self.cache.pass_index + 1 >= WARMUP:  # the warm-up measured: the pools resized
            self._warming = False
            self.budget.measure()
            resplit = mem is None
        if mem is not None:
            if contexts is None:
                contexts = (context,)
            left, kv = mem.budget(contexts)
            if left < 0:
                raise ConfigError(f"hardware.memory_gb={self.spec.hardware.memory_gb:g} cannot hold forward pass "
                                  f"{self.cache.pass_index + 1}: {mem.describe(contexts)}")
            caps = self._split(left)
            fb = self._slot_bytes
            slots = 0
            for c in caps:
                slots += c // fb
            mem.series.append((sum(caps), kv, slots))
            self.cache.resize(caps, kv)
        elif resplit:
            self.cache.resize(self._split(self._total), -1)
        self.cache.begin_pass(kind, tokens, context)

    def _split(self, total: int) -> list:
        """``total`` bytes between the pools: evenly, or by the layers' working sets once measured."""
        ceilings = self.cache.ceilings
        if self.budget is not None and self.budget.working_set:
            return self.budget.split(total, self._fetch_bytes, ceilings)
        n = len(ceilings)
        share = total // n if total > 0 else 0
        return [share if share < c else c for c in ceilings]

    def end_pass(self):
        self.cache.end_pass()

    # ---- one MoE layer call ---------------------------------------------------------------------
    def route(self, rec):
        """Number the call and let the routing policy change the selection (dual-logit semantics: the new
        selection is weighted by the original probabilities). True if the selection changed."""
        r = rec
        r.call = self.calls
        self.calls += 1
        if not self._routes:
            return False
        routed = self.routing.route(rec, self.view)  # a Routed, or None: the router's selection untouched
        if routed is None:
            return False
        rec.index = routed.index
        rec.weights = routed.weights.to(rec.weights.dtype)
        rec.void = routed.void
        return True

    def layer(self, rec, index=None, weights=None):
        """Serve one MoE layer call. ``index``/``weights``: the selection the model's block passes to its
        experts (default: the record's). Returns None when the layer runs exactly as routed, else the
        :class:`Execution` its experts must run.

        1. dense compute up to this layer's experts (attention, norms, router, shared experts);
        2. the requested experts: the union of the selection's experts, ascending;
        3. the cache serves them: hits, then misses through the miss policy's outcomes; stall until ready;
        4. routing fidelity, and the device's share of the expert work;
        5. prefetches for later layers, issued as this layer's experts start computing; then, after a
           streamed call, the next layer staged ahead (``hardware.stream_layers``);
        6. the experts' compute; the layer's experts are unpinned.
        """
        cache = self.cache
        clock = self.clock
        r = rec
        layer = r.layer
        shape = cache.current_pass  # [kind, tokens, context, ...]
        if shape is not None:  # 1
            clock.dense(layer, shape[1], shape[2])
        experts = r.requested(self._E)  # 2
        if self._warming:  # (hardware.layer_budget=proportional's warm-up)
            self.budget.observe(layer, experts)
        plan = cache.serve(layer, experts, rec, index, weights).execution  # 3
        self._fidelity(rec, index, plan, len(experts))  # 4 (sets _run_slots, _run_n)
        if self._Z:  # an identity expert's slots compute nothing
            ran = plan.index if plan is not None else rec.index if index is None else index
            identity = ran.ge(self._E)
            void = rec.void if rec.rerouted else None
            self._run_slots -= int((identity if void is None else identity & ~void).sum())  # (a void slot: once)
        if self._predicts:  # 5
            for target, predicted in self.prefetch.predict(rec, self.model):
                clock.predicted()
                self.predictions += 1
                cache.prefetch(target, [e for e in predicted if e < self._E] if self._Z else predicted)
        if self._streams:
            cache.streaming.stage_ahead()
        clock.experts(self._run_slots, self._run_n, len(plan.precisions) if plan is not None else 0)  # 6
        cache.finish_layer()
        return plan

    def _fidelity(self, rec, index, plan, n: int):
        """Count the router's own selections that run unchanged; the device's share of the work is left in
        ``_run_slots`` (token-expert slots) and ``_run_n`` (experts)."""
        st = self.cache.stats
        r = rec
        layer = r.layer
        slots = r._slots if r._slots >= 0 else rec.slots  # (the field once known: no property call)
        st.slots_total += slots
        rerouted = r._index is not None and rec.rerouted  # (no property call while no routing policy set one)
        if not rerouted and plan is None:
            st.requests_router[layer] += n
            st.slots_unchanged += slots
            self._run_slots, self._run_n = slots, n
            return
        if index is None:
            index = rec.index
        if rerouted:  # the router's own requests, before a routing policy changed the selection
            st.requests_router[layer] += int(expert_counts(rec.original, self._E).count_nonzero())  # (no identity)
        else:
            st.requests_router[layer] += n
        kept = torch.ones_like(index, dtype=torch.bool) if plan is None else plan.kept
        if plan is not None:  # the plan's device share already leaves out emptied slots
            slots, n = plan.slots, plan.n_run
        if rerouted:
            kept = kept & (index.unsqueeze(-1) == rec.original.unsqueeze(-2)).any(-1)
            void = rec.void  # slots the routing policy declared empty (prune): not run, not faithful
            if void is not None:
                kept &= ~void
                if plan is None:
                    slots -= int(void.sum())
        st.slots_unchanged += int(kept.sum())
        self._run_slots, self._run_n = slots, n

    # ---- results --------------------------------------------------------------------------------
    def _lateness(self, summary: dict) -> Optional[dict]:
        """Whether late prefetches are a policy effect or structural. A prefetch for layer l+d (d = the
        prefetch policy's depth, 1 for next-layer prefetch) is issued as layer l's experts start, so it can
        only arrive in time if one expert's transfer fits in the compute between: the experts of layers
        l..l+d-1 and the dense parts of layers l+1..l+d. ``structural`` when it fits for no layer of a decode
        token: then every decode prefetch is late whatever the policy predicts, and prefetch hit rates
        measure the link, not the predictor (``in_cache_rate`` still compares predictors). With a tiny
        model's microsecond layers this is an artefact (``hardware.timing_as`` gives a real model's
        ratio); for a real model at batch 1 over PCIe it is often the truth. None without prefetches or
        decode passes, or when the clock cannot say in advance."""
        if not summary["prefetch_issued"] or not any(p.kind == "decode" for p in self.cache.stats.passes):
            return None
        clock, g = self.clock, self.geom
        if clock.experts_time(1, 1) is None:
            return None
        pcls, pparams = self.spec.prefetch
        d = max(1, pcls.signal_depth(pparams))
        step = [clock.experts_time(g.top_k, g.top_k) + clock.dense_time(l + 1, 1, 1) for l in range(g.num_layers - 1)]
        windows = [sum(step[l:l + d]) for l in range(g.num_layers - d)]
        if not windows:
            return None
        transfer = clock.transfer_time(self.store.bytes_of[self.cache.fetch_precision])
        used = summary["prefetch_used"]
        return {
            "late_fraction": summary["prefetch_late"] / used if used else None,
            "transfer_s": transfer,
            "decode_window_s": max(windows),
            "structural": transfer > max(windows),
        }

    def _fetch_bounds(self) -> dict:
        """The decode speed no fetch-only stack can pass on this link: one native expert's transfer per miss,
        back to back (``fetch_bound_tokens_per_s``: at the run's decode misses per token;
        ``all_miss_bound_tokens_per_s``: at hit rate 0, every requested expert fetched). A stack that computes
        misses on the host (``hybrid``, ``cpu_compute``) or fetches smaller copies can pass them."""
        dec = [p for p in self.cache.stats.passes if p.kind == "decode"]
        tokens = sum(p.tokens for p in dec)
        try:
            t = self.clock.transfer_time(self.store.bytes_of["native"])
        except NotImplementedError:
            return {}
        if not tokens or not t > 0:
            return {}
        misses, requests = sum(p.misses for p in dec) / tokens, sum(p.requests for p in dec) / tokens
        return {"fetch_bound_tokens_per_s": 1.0 / (misses * t) if misses else None,
                "all_miss_bound_tokens_per_s": 1.0 / (requests * t) if requests else None}

    def results(self) -> dict:
        """The ``cache``, ``timing`` and ``routing`` sections of results.json."""
        cache = self.cache
        cache.finalize()
        st = cache.stats
        summary = st.summary()
        g = self.geom
        fetch_bytes = self.store.bytes_of[cache.fetch_precision]
        summary["capacity_bytes"] = sum(p.capacity for p in cache.pools)
        summary["expert_bytes"] = g.expert_bytes
        summary["model_bytes"] = g.total_bytes
        summary["layers"] = list(g.layer_ids)
        summary["measured_passes"] = cache.measure
        summary["timing_geometry"] = self.timing_as or "model"
        if self.memory is not None:
            summary["memory"] = self.memory.section()
        if self.spec.hardware.scope == "per_layer":
            summary["layer_budget"] = {
                "rule": getattr(self.spec.hardware, "layer_budget", "uniform"),
                "slots": [p.capacity // fetch_bytes for p in cache.pools],
                "working_set": self.budget.working_set if self.budget is not None else None,
                "warmup_passes": WARMUP if self.budget is not None else None,
                "measured": bool(self.budget is not None and self.budget.working_set),
            }
        summary["prefetch_lateness"] = self._lateness(summary)
        summary["union"] = union_section(st, g.num_layers, g.num_experts, g.top_k, cache.measure,
                                         static_slots(cache, self.memory, fetch_bytes))
        timing = st.timing(self.clock.name)
        timing.update(self.clock.busy())  # every pass's, as total_s (a measure=decode run too)
        timing.update(self._fetch_bounds())
        return {"cache": summary, "timing": timing, "routing": {"fidelity": st.fidelity()}}
