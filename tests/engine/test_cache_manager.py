"""Hand-worked traces for the cache manager + LRU, and invariants under random traces."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from specmd.engine.cache import CacheManager
from specmd.engine.link import TransferChannel
from specmd.engine.simclock import Roofline, SimClock
from specmd.engine.geometry import Geometry
from specmd.policies.eviction import EVICTION
from specmd.policies.miss import MISS

LRU = EVICTION.get("lru")


def manager(capacity_experts, layers=2, experts=4, expert_bytes=100, bw=1000.0, latency=0.01,
            dense=(0, 0), expert_params=0, peak=1e3, pools=None):
    geom = Geometry(num_layers=layers, num_experts=experts, top_k=2, expert_bytes=expert_bytes,
                    total_bytes=1000, hidden_size=0, dtype_bytes=1, dense_params=(list(dense) + [0] * layers)[:layers],
                    attn_layers=[0] * layers, tail_params=0, expert_params=expert_params)
    clock = SimClock(geom, TransferChannel(bw, latency), Roofline(peak, 1e15))
    caps = pools or [capacity_experts * expert_bytes]
    return CacheManager(geom, caps, [LRU() for _ in caps], MISS.build({"name": "fetch"}), clock)


def run_pass(m, requests, prefetch=None, tokens=1):
    m.begin_pass("prefill", tokens, tokens)
    for layer, experts in enumerate(requests):
        m.clock.dense(layer, tokens, tokens)
        m.serve(layer, sorted(experts))
        for target, pred in (prefetch or {}).get(layer, []):
            m.prefetch(target, pred)
        m.clock.experts(len(experts) * tokens, len(experts))
        m.finish_layer()
        m.check_invariants()
    m.end_pass()


def test_lru_hand_worked_two_passes():
    # Capacity 3 experts. Pass 0: L0 {0,1}, L1 {2,3}; pass 1 the same.
    # Pass 0: 4 compulsory misses; inserting (1,3) evicts LRU (0,0).            evictions 1
    # Pass 1: L0: (0,1) hit; (0,0) miss, evicts (1,2) (LRU, not pinned).         evictions 2
    #         L1: (1,3) hit; (1,2) miss -- evicted earlier in this pass: a collision; evicts (0,1).
    m = manager(3)
    run_pass(m, [[0, 1], [2, 3]])
    st = m.stats
    assert (st.total("requests"), st.total("hits"), st.total("misses"), st.total("evictions")) == (4, 0, 4, 1)
    assert st.total("collision_misses") == 0
    run_pass(m, [[0, 1], [2, 3]])
    assert list(st.hits) == [1, 1] and list(st.misses) == [3, 3]
    assert list(st.evictions) == [2, 1]  # evicted: (0,0) in pass 0; (1,2) then (0,1) in pass 1
    assert list(st.collision_misses) == [0, 1]
    assert sorted(m.entries) == [0, 6, 7]  # keys layer*4+expert: (0,0), (1,2), (1,3)
    assert [p.collision_misses for p in st.passes] == [0, 1]
    assert [p.hits for p in st.passes] == [0, 2]


def test_lru_tie_break_lower_index_first():
    # Capacity 2; L0 requests {1, 0} together (served in ascending index: 0 then 1),
    # then L1 requests {2}: the victim is expert 0, the older of the two.
    m = manager(2)
    run_pass(m, [[1, 0], [2]])
    assert sorted(m.entries) == [1, 6]


def test_resident_view_excludes_prefetches_in_flight():
    # the view cache-aware routing reads: resident experts whose bytes have arrived
    m = manager(4)
    run_pass(m, [[0, 1], []])
    m.prefetch(0, [3])  # queued at the current time, not arrived yet
    assert m.view.resident(0) == [0, 1]
    m.clock.now += 1.0
    m.clock.channel.advance(m.clock.now)
    assert m.view.resident(0) == [0, 1, 3]


def test_working_set_larger_than_pool_streams():
    m = manager(2, experts=8)
    run_pass(m, [[0, 1, 2, 3, 4], []])
    st = m.stats
    assert st.misses[0] == 5 and st.streamed[0] == 3
    assert m.pools[0].used == 200 and st.peak_bytes == 200
    assert st.bytes_demand[0] == 500


def test_per_layer_pools_never_evict_other_layers():
    m = manager(0, pools=[100, 100])
    run_pass(m, [[0], [1]])
    run_pass(m, [[2], [1]])
    assert list(m.stats.hits) == [0, 1]
    assert sorted(m.entries) == [2, 5]


def test_prefetch_reserves_space_and_counts_use():
    m = manager(4)
    run_pass(m, [[0, 1], [2, 3]], prefetch={0: [(1, [2, 3])]})
    st = m.stats
    assert list(st.prefetch_issued) == [0, 2] and list(st.bytes_prefetch) == [0, 200]
    assert st.prefetch_used[1] == 2
    assert st.hits[1] + st.prefetch_late[1] == 2


@settings(max_examples=60, deadline=None)
@given(
    cap=hs.integers(1, 6),
    scope_per_layer=hs.booleans(),
    passes=hs.lists(hs.lists(hs.sets(hs.integers(0, 5), max_size=4), min_size=3, max_size=3), min_size=1, max_size=6),
    prefetch_sets=hs.lists(hs.sets(hs.integers(0, 5), max_size=3), min_size=3, max_size=3),
)
def test_invariants_random_traces(cap, scope_per_layer, passes, prefetch_sets):
    pools = [cap * 100] * 3 if scope_per_layer else None
    m = manager(cap, layers=3, experts=6, pools=pools)
    for reqs in passes:
        pf = {l: [(l + 1, sorted(prefetch_sets[l + 1]))] for l in range(2)}
        run_pass(m, reqs, prefetch=pf)  # run_pass checks occupancy and hits + misses = requests per layer
    st = m.stats
    assert st.total("requests") == sum(len(r) for p in passes for r in p)
    assert st.peak_bytes <= sum(p.capacity for p in m.pools)
    assert st.total("collision_misses") <= st.total("misses")
    assert st.total("prefetch_used") <= st.total("prefetch_issued")


def test_view_of_a_key_outside_the_model_is_absent_never_another_key():
    """Residency is one per-key array; a key outside ``0 .. layers * experts - 1`` is not in the cache (a
    negative key must not wrap around to the last one)."""
    m = manager(8)
    run_pass(m, [[0], [3]])  # keys 0 and 7 (the last key of 2 layers x 4 experts)
    v = m.view
    assert 7 in v and v.precision(7) == "native" and m.entry(7) == m.entries[7]
    for key in (-1, -8, 8, 1 << 40):
        assert key not in v and v.precision(key) is None and v.nbytes(key) is None and not v.in_flight(key)
        assert m.entry(key) is None
    assert sorted(m.entries) == [0, 7]
    for key in (-1, 3, 8):  # not in the cache: evicting it is a KeyError (-1 never means the last key)
        with pytest.raises(KeyError):
            m.evict(key)
    assert not m.evictable(3)  # a key not in the cache (a policy's ghost) is not evictable
    assert sorted(m.entries) == [0, 7]


def test_requests_outside_the_model_are_errors_in_both_builds_never_another_key():
    """The compiled request path indexes its arrays unchecked once a call's experts are checked: an expert or
    a layer out of range, a float expert (compiled, it would be truncated to a key), a key inserted into
    another layer's pool are errors, the same in the pure build; numpy integers are integers."""
    import numpy as np

    m = manager(8)
    m.begin_pass("prefill", 1, 1)
    for bad, err in (([4], IndexError), ([-1], IndexError), ([1.5], TypeError)):
        with pytest.raises(err):
            m.serve(0, bad)
        m.finish_layer()
    with pytest.raises(IndexError):
        m.serve(2, [0])
    m.serve(0, [np.int64(1)])
    m.finish_layer()
    for layer, experts, err in ((0, [4], IndexError), (-1, [0], IndexError), (1, [2.7], TypeError)):
        with pytest.raises(err):
            m.prefetch(layer, experts)
    with pytest.raises(IndexError):
        m.clock.dense(2, 1, 1)
    with pytest.raises(IndexError):
        m.clock.dense_time(5, 1, 1)
    with pytest.raises(IndexError):  # key 5 is layer 1's: not layer 0's, nor its pool's when pools are per layer
        m.insert(5, 0, 100, m.pools[0], None, False)
    m.end_pass()
    assert sorted(m.entries) == [1] and m.stats.total("requests") == 1
    m.check_invariants()

