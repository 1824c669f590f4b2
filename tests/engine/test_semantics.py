"""Semantic rules pinned by hand-worked cases: each test fails if its rule is broken by a one-line change
(Least-Stale's FIFO and what makes an expert current, prefetch promotion, the miss outcomes' execution,
host time, substitute pinning) and the accounting fields no other test reads."""

import math

import pytest
import torch

from specmd.engine import Engine, LiveRecord, Geometry, Scoring
from specmd.compose import spec_of
from specmd.engine.cache import CacheManager
from specmd.engine.link import TransferChannel
from specmd.engine.simclock import Roofline, SimClock
from specmd.hardware import HardwareConfig
from specmd.policies.eviction import EVICTION
from specmd.policies.miss import MISS

SOFTMAX = Scoring(False, False, 1.0)


def manager(policy, capacity_experts, layers=3, experts=4, bw=100.0):
    """Expert = 100 bytes; ``bw`` bytes/s (default: one expert per simulated second); compute is free."""
    geom = Geometry(num_layers=layers, num_experts=experts, top_k=1, expert_bytes=100, total_bytes=10**6)
    clock = SimClock(geom, TransferChannel(bw, 0.0), Roofline(1e15, 1e15))
    return CacheManager(geom, [capacity_experts * 100], [EVICTION.get(policy)()], MISS.build({"name": "fetch"}), clock)


def call(m, layer, experts):
    m.serve(layer, experts)
    m.finish_layer()


# ---- Least-Stale --------------------------------------------------------------------------------------------
def test_least_stale_is_fifo_within_a_layer():
    m = manager("least_stale", 2, layers=2, bw=1e12)
    m.begin_pass("decode", 1, 1)
    call(m, 0, [0])  # (0,0) joins first
    call(m, 0, [1])  # (0,1) second
    m.end_pass()
    m.begin_pass("decode", 1, 2)  # both stale, same layer
    call(m, 1, [0])  # miss: FIFO evicts (0,0), not the later (0,1)
    assert sorted(m.entries) == [1, 4]


def test_least_stale_prefetched_experts_are_current():
    m = manager("least_stale", 2, layers=3, bw=1e12)
    m.begin_pass("decode", 1, 1)
    call(m, 0, [0])
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    m.serve(0, [1])  # evicts nothing (room for 2): {(0,0) stale, (0,1) current}
    m.prefetch(2, [0])  # needs room: evicts the stale (0,0); (2,0) is current (prefetched this pass)
    m.finish_layer()
    m.clock.compute(1e15, 0)  # the prefetch arrives
    # both residents current: the left (0,1) goes in every reading, the prefetched (2,0) of an upcoming layer
    # stays (were it stale it would go first)
    call(m, 1, [0])
    assert sorted(m.entries) == [4, 8]


def test_least_stale_a_hit_makes_an_expert_current():
    m = manager("least_stale", 2, layers=2, bw=1e12)
    m.begin_pass("decode", 1, 1)
    call(m, 0, [0])
    call(m, 1, [0])
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    call(m, 0, [0])  # hit: (0,0) current again
    call(m, 1, [1])  # miss: the only stale expert is (1,0)
    assert sorted(m.entries) == [0, 5]


# ---- the transfer channel -------------------------------------------------------------------------------------
def test_a_requested_queued_prefetch_is_promoted_to_demand_priority():
    m = manager("lru", 4, layers=2)
    m.begin_pass("decode", 1, 1)
    m.prefetch(1, [0, 1])  # both queued at t=0, (1,0) first
    call(m, 1, [1])  # (1,1) is requested: served before the queued (1,0), ready after one transfer
    assert m.stats.stall_s[1] == pytest.approx(1.0)
    assert m.stats.prefetch_late[1] == 1 and m.stats.misses[1] == 1 and m.stats.hits[1] == 0
    m.end_pass()


# ---- miss outcomes through the engine --------------------------------------------------------------------------
def engine(miss, slots=4, bw_bytes=100.0, host_s_per_expert=None, **policies):
    geom = Geometry(num_layers=1, num_experts=4, top_k=1, expert_bytes=100, total_bytes=400, expert_params=50)
    hw = dict(experts_per_layer=slots, bandwidth_gbps=bw_bytes / 1e9, latency_us=0.0, peak_tflops=1e6,
              mem_bandwidth_gbps=1e9)
    if host_s_per_expert is not None:  # host roofline: 2 * 50 flops per token-expert pair
        hw.update(host_tflops=100.0 / host_s_per_expert / 1e12, host_mem_bandwidth_gbps=1e9)
    return Engine(geom, spec_of(miss=miss, prefetch="none", hardware=HardwareConfig(**hw), **policies))


def record(probs, index):
    probs = torch.tensor(probs)
    index = torch.tensor(index)
    return LiveRecord(0, probs.log(), SOFTMAX.weigh(probs, index), index, SOFTMAX)


def layer(eng, rec):
    eng.route(rec)
    return eng.layer(rec)


def test_drop_zeroes_the_dropped_experts_weight():
    eng = engine({"name": "drop", "J": 0})
    plan = layer(eng, record([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], [[0], [3]]))
    assert plan.weights.tolist() == [[0.0], [0.0]] and plan.index.tolist() == [[0], [3]]
    assert (plan.slots, plan.n_run) == (0, 0) and list(eng.cache.stats.dropped) == [2]


def test_substitute_changes_the_index_and_pins_the_substitute():
    eng = engine({"name": "substitute", "alpha": 0.5}, slots=2)
    layer(eng, record([[0.1, 0.6, 0.2, 0.1]], [[1]]))  # (0,1) resident, older
    layer(eng, record([[0.1, 0.1, 0.2, 0.6]], [[3]]))  # (0,3) resident: the cache is full, LRU = 1
    # token 0 selects 0 (missing; .40 < 1.5 * S2 = .525): expert 1 (.35, resident, unselected) substitutes it;
    # token 1 selects 2 (missing, not low-score) -> fetched: room is made by evicting 3, never the pinned 1
    plan = layer(eng, record([[0.40, 0.35, 0.15, 0.10], [0.05, 0.05, 0.6, 0.3]], [[0], [2]]))
    assert plan.index.tolist() == [[1], [2]]
    assert sorted(eng.cache.entries) == [1, 2]
    st = eng.cache.stats
    assert list(st.substituted) == [1] and st.fidelity() == pytest.approx(3 / 4)  # 4 slots, one changed


def test_host_compute_takes_host_time():
    # two misses: the two-pointer loads the higher-scored one (1 s) and computes the other on the host (3 s)
    eng = engine("cpu_compute", host_s_per_expert=3.0)
    plan = layer(eng, record([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], [[0], [3]]))
    st = eng.cache.stats
    assert list(st.host_computed) == [1] and list(st.streamed) == [0]
    assert st.stall_s[0] == pytest.approx(3.0)  # compute waits for the host, the slower of the two
    assert (plan.slots, plan.n_run) == (1, 1)


# ---- accounting fields ------------------------------------------------------------------------------------------
def test_prefetch_and_pass_accounting_fields():
    # capacity 2 experts, 2 layers. Pass 0 (prefill): L0 {0} miss; prefetch L1 {1, 2}: (1,1) issued, the
    # second finds no room (the running layer's expert is pinned, (1,1) in flight) -> skipped. L1 {1}: the
    # prefetch is still in flight (late). Pass 1 (decode): L0 {0} hit; prefetch L1 {3}: evicts... nothing
    # evictable but (1,1) -> issued, (1,1) evicted. L1 {3} late again. Finalize: nothing unused.
    m = manager("lru", 2, layers=2)
    m.begin_pass("prefill", 4, 4)
    m.serve(0, [0]); m.prefetch(1, [1, 2]); m.finish_layer()
    call(m, 1, [1])
    m.end_pass()
    m.begin_pass("decode", 1, 5)
    m.serve(0, [0]); m.prefetch(1, [3]); m.finish_layer()
    call(m, 1, [3])
    m.end_pass()
    m.finalize()
    s = m.stats.summary()
    assert (s["requests"], s["hits"], s["misses"], s["prefetch_late"]) == (4, 1, 3, 2)
    assert (s["prefetch_issued"], s["prefetch_skipped"], s["prefetch_wasted"], s["prefetch_used"]) == (2, 1, 0, 2)
    assert s["in_cache_rate"] == pytest.approx(3 / 4) and s["hit_rate"] == pytest.approx(1 / 4)
    assert s["prefill_hit_rate"] == 0.0 and s["decode_hit_rate"] == pytest.approx(1 / 2)
    assert s["prefetch_precision"] == pytest.approx(2 / 3) and s["prefetch_recall"] == 1.0
    assert s["collision_rate"] == 0.0
    t = m.stats.timing()
    assert t["tokens_per_s"] == pytest.approx(5 / t["total_s"]) and t["total_s"] > 0


def test_wasted_prefetch_and_collision_rate():
    m = manager("lru", 1, layers=2, bw=1e12)
    m.begin_pass("decode", 1, 1)
    m.serve(0, [0]); m.prefetch(1, [1]); m.finish_layer()  # no room: (0,0) pinned -> skipped
    call(m, 1, [2])  # evicts (0,0)
    call(m, 0, [0])  # (0,0) again in the same pass: a collision miss
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    m.prefetch(1, [3])  # evicts (0,0); never used before the run ends
    m.end_pass()
    m.finalize()
    s = m.stats.summary()
    assert s["collision_misses"] == 1 and s["collision_rate"] == pytest.approx(1 / 3)
    assert s["prefetch_wasted"] == 1 and s["prefetch_skipped"] == 1
    assert not math.isnan(s["cache_lifetime"])


@pytest.fixture(scope="module")
def embedded():
    from specmd.models.loader import ModelConfig, load_model

    return load_model(ModelConfig(family="olmoe", pretrained="specmd:tiny-olmoe"))


def test_token_by_token_scores_one_token_per_pass(embedded):
    """eval.token_by_token: the window goes through the KV cache one token per forward pass (one prefill,
    then decode steps), with the same logits as the whole-window forward."""
    from tests.conftest import make_stack

    from specmd.eval.harness import _token_by_token_lm

    model, tok = embedded
    lm = _token_by_token_lm()(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    ids = torch.randint(0, 4000, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
    stack = make_stack(model, "olmoe", prefetch="none", capacity=0.25)
    with stack:
        out = lm._model_call(ids)
    assert torch.allclose(out, ref, atol=1e-4)
    passes = stack.engine.cache.stats.passes
    assert [p.kind for p in passes] == ["prefill"] + ["decode"] * 11 and all(p.tokens == 1 for p in passes)
    timing = stack.engine.results()["timing"]
    assert (timing["prefill_passes"], timing["decode_passes"]) == (1, 11)
    assert timing["decode_tokens_per_s"] == pytest.approx(11 / sum(p.time_s for p in passes[1:]))


def test_pruned_slots_are_not_counted_twice_by_outcomes():
    # prune h=1 on top-2: each token's second slot points at its top-1 expert with weight 0 (not run).
    # drop J=0 then drops every miss: the device runs nothing -- 0 slots, not a negative count.
    geom = Geometry(num_layers=1, num_experts=4, top_k=2, expert_bytes=100, total_bytes=400, expert_params=50)
    hw = HardwareConfig(experts_per_layer=4, bandwidth_gbps=1e-7, latency_us=0.0)
    for miss, device_slots, host in (({"name": "drop", "J": 0}, 0, 0), ("cpu_compute", 1, 1)):
        eng = Engine(geom, spec_of(routing={"name": "prune", "h": 1}, miss=miss, prefetch="none", hardware=hw))
        probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]])
        index = torch.tensor([[0, 1], [3, 2]])
        rec = LiveRecord(0, probs.log(), SOFTMAX.weigh(probs, index), index, SOFTMAX)
        plan = layer(eng, rec)
        assert plan.slots == device_slots, miss
        assert list(eng.cache.stats.host_computed) == [host]


# ---- which passes count -----------------------------------------------------------------------------------------
def test_measure_decode_counts_decode_passes_only():
    # capacity 2, one layer of 4 experts. Prefill {0, 1}: 2 misses (rolled back); decode {0}: a hit the
    # prefill warmed; decode {2}: a miss evicting 1 (LRU). Counted: 2 requests, 1 hit, 1 miss, 1 eviction.
    geom = Geometry(num_layers=1, num_experts=4, top_k=1, expert_bytes=100, total_bytes=10**6)
    for measure, expect in (("decode", (2, 1, 1, 1)), ("all", (4, 1, 3, 1))):
        clock = SimClock(geom, TransferChannel(100.0, 0.0), Roofline(1e15, 1e15))
        m = CacheManager(geom, [200], [EVICTION.get("lru")()], MISS.build({"name": "fetch"}), clock, measure=measure)
        for kind, experts in (("prefill", [0, 1]), ("decode", [0]), ("decode", [2])):
            m.begin_pass(kind, 1, 1)
            call(m, 0, experts)
            m.end_pass()
        st = m.stats
        assert (st.total("requests"), st.total("hits"), st.total("misses"), st.total("evictions")) == expect
        assert [p.kind for p in st.passes] == ["prefill", "decode", "decode"]  # the timing keeps every pass
        assert st.passes[0].misses == 2 and st.summary()["prefill_hit_rate"] == 0.0
        m.check_invariants()


def test_measure_decode_prefill_prefetches_count_as_neither_issued_used_nor_wasted():
    # capacity 3, 2 layers. Prefill (not counted): L0 {0} prefetches (1,0) and (1,1); L1 {0} uses (1,0).
    # Decode: L0 {0} hits; L1 {1} hits the prefill's unused prefetch: a hit, not a used prefetch.
    geom = Geometry(num_layers=2, num_experts=4, top_k=1, expert_bytes=100, total_bytes=10**6)
    clock = SimClock(geom, TransferChannel(1e12, 0.0), Roofline(1e15, 1e15))
    m = CacheManager(geom, [300], [EVICTION.get("lru")()], MISS.build({"name": "fetch"}), clock, measure="decode")
    m.begin_pass("prefill", 1, 1)
    m.serve(0, [0]); m.prefetch(1, [0, 1]); m.finish_layer()
    m.clock.compute(1e15, 0)
    call(m, 1, [0])
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    call(m, 0, [0])
    call(m, 1, [1])
    m.end_pass()
    m.finalize()
    s = m.stats.summary()
    assert (s["requests"], s["hits"]) == (2, 2)
    assert (s["prefetch_issued"], s["prefetch_used"], s["prefetch_wasted"]) == (0, 0, 0)


def test_stats_restore_drops_counters_created_since():
    from specmd.engine.stats import CacheStats

    st = CacheStats(2)
    snap = st.snapshot()
    st.add("rerouted_to_host", 1)
    st.peak_bytes = 500
    st.requests[0] += 3
    st.restore(snap)
    assert st.extra == [] and not hasattr(st, "rerouted_to_host")
    assert st.peak_bytes == 0 and list(st.requests) == [0, 0]


def test_stats_per_precision_counts_and_restore():
    """Fetches and bytes per stored precision are C counters: a precision is listed once counted (a prefetch
    moves bytes but fetches nothing), one beyond the store's joins on first use, restore undoes both."""
    from specmd.engine.stats import CacheStats

    st = CacheStats(1, ["native", "int4"])
    st.count_precision("int4", 30, fetched=0)  # a prefetch
    assert st.fetched_by_precision == {} and st.bytes_by_precision == {"int4": 30}
    snap = st.snapshot()
    st.count_precision("native", 200, 2)
    st.count_precision("int2", 10, 1)  # not in the store's list
    assert st.fetched_by_precision == {"native": 2, "int2": 1}
    assert st.bytes_by_precision == {"native": 200, "int4": 30, "int2": 10}
    st.restore(snap)
    assert st.fetched_by_precision == {} and st.bytes_by_precision == {"int4": 30}
    with pytest.raises(IndexError):
        st.count(7, 1, 1)


def test_passive_hooks_are_skipped_and_a_subclass_that_overrides_one_is_called():
    """Standard routing, prefetch=none and miss=fetch declare their hook passive (it always answers "no
    change"), so the engine never calls it per layer call; a subclass with its own hook is called as usual."""
    import dataclasses

    from specmd.policies.miss.fetch import Fetch
    from specmd.policies.prefetch.none import NoPrefetch
    from specmd.policies.routing.standard import Standard

    base = engine("fetch")
    assert base.routing.passive() and base.prefetch.passive() and base.miss.passive()
    calls = []

    class Rerouting(Standard):
        def apply(self, record, cache):
            calls.append("apply")
            return torch.full_like(record.original, 3)

    class Predicting(NoPrefetch):
        def predict(self, record, model):
            calls.append("predict")
            return [(0, [2])]

    class Counting(Fetch):
        def handle(self, layer, missing, record, cache):
            calls.append(("handle", list(missing)))
            return None

    spec = base.spec
    spec = dataclasses.replace(spec, routing=(Rerouting, spec.routing[1]), prefetch=(Predicting, spec.prefetch[1]),
                               miss=(Counting, spec.miss[1]))
    eng = Engine(base.geom, spec)
    assert not (eng.routing.passive() or eng.prefetch.passive() or eng.miss.passive())
    layer(eng, record([[0.4, 0.3, 0.2, 0.1]], [[0]]))
    assert calls == ["apply", ("handle", [3]), "predict"]
    assert sorted(eng.cache.entries) == [2, 3] and list(eng.cache.stats.prefetch_issued) == [1]


# ---- the host as a resource; host overheads beside the device (a GPU) ----------------------------------------------
def host_clock(overlap=False, **over):
    """Expert = 50 params / 100 bytes; one decoder layer per MoE layer, no dense compute. Device: 100 flop/s (a
    token-expert pair: 1 s); host: 50 flop/s (2 s per pair); memory and link instant unless given."""
    geom = Geometry(num_layers=2, num_experts=4, top_k=1, expert_bytes=100, total_bytes=10**6, expert_params=50,
                    dense_params=[0, 0], attn_layers=[1, 1])
    return SimClock(geom, TransferChannel(over.pop("bw", 1e15), 0.0), Roofline(100.0, 1e15), Roofline(50.0, 1e15),
                    overlap=overlap, **over)


def test_host_work_runs_beside_the_devices_experts_and_queues_on_the_host():
    c = host_clock(host_overheads=(0.0, 0.5, 0.0))
    h = c.host(1, 1)  # 2 s of roofline + 0.5 s per expert: ready at 2.5
    assert c.host_backlog() == pytest.approx(2.5)
    h2 = c.host(1, 1)  # queued behind the first: 2.5 .. 5.0
    c.experts(2, 2)  # the device's experts: 2 s, beside the host
    assert c.now == pytest.approx(2.0)
    assert c.wait([h]) == pytest.approx(0.5) and c.wait([h2]) == pytest.approx(2.5)  # the output waits for the host
    assert c.busy()["host_busy_s"] == pytest.approx(5.0) and c.now == pytest.approx(5.0)
    # per batch sent (once), per expert, per token-expert pair: 3 pairs over 2 experts = 6 s of roofline + 1 + 2 x 0.5
    # + 3 x 0.25; no work, no cost
    c = host_clock(host_overheads=(1.0, 0.5, 0.25))
    assert c.host_time(3, 2) == pytest.approx(8.75) and c.host_time(0, 0) == 0.0


def test_the_engine_waits_for_the_host_after_or_before_the_devices_experts():
    # one miss on the host (3 s) and a hit whose device compute takes 2 s. A host of its own (host_overlap, a
    # GPU's): beside the device, the layer ends at 3 (stall 1). The host on the device's cores (a CPU): the
    # device's experts wait for it, 3 + 2 = 5 (stall 3)
    geom = Geometry(num_layers=1, num_experts=4, top_k=1, expert_bytes=100, total_bytes=400, expert_params=50)
    for overlap, end, stall in ((True, 3.0, 1.0), (False, 5.0, 3.0)):
        hw = HardwareConfig(experts_per_layer=4, bandwidth_gbps=1e-9, latency_us=0.0, peak_tflops=100.0 / 2 / 1e12,
                            mem_bandwidth_gbps=1e9, host_tflops=100.0 / 3 / 1e12, host_mem_bandwidth_gbps=1e9,
                            host_overlap=overlap)
        eng = Engine(geom, spec_of(miss="hybrid", prefetch="none", hardware=hw))
        eng.cache.prefetch(0, [0])  # expert 0 resident: prefetched (100 s on this link), arrived before the pass
        eng.clock.wait_until(100.0)
        eng.clock.stall_s = 0.0
        eng.begin_pass("decode", 2, 2)
        rec = record([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]], [[0], [3]])
        plan = layer(eng, rec)  # expert 3: a fetch takes 100 s; the host 3 s -> host
        eng.end_pass()
        assert plan.host == [3] and list(eng.cache.stats.host_computed) == [1]
        st = eng.cache.stats
        assert st.passes[0].time_s == pytest.approx(end) and st.stall_s[0] == pytest.approx(stall), overlap
        t = eng.results()["timing"]
        assert t["host_busy_s"] == pytest.approx(3.0) and t["link_busy_s"] == pytest.approx(100.0)  # (the prefetch)


def test_overlap_takes_the_longer_of_host_overheads_and_device_compute_per_sync():
    # per decoder layer 3 s of host overhead, per expert 0.5 s; the device: 1 s per pair. In order (a CPU): 2 x (3 +
    # 1 + 0.5) = 9. Overlapped (a GPU), per segment between synchronisations: up to layer 0's read-back max(3 host, 0
    # device) = 3; to layer 1's max(0.5 + 3, 1) = 3.5; to the logits max(0.5, 1) = 1 -> 7.5
    for overlap, expect in ((False, 9.0), (True, 7.5)):
        c = host_clock(overlap=overlap, overheads=(3.0, 0.0, 0.5, 0.0, 0.0, 0.0))
        for layer in (0, 1):
            c.dense(layer, 1, 1)
            c.begin_layer()  # the read-back of the routing: a synchronisation under overlap
            c.experts(1, 1)
        c.tail(0, 1)
        assert c.now == pytest.approx(expect), overlap
