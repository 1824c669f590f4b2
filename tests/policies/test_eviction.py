"""Every eviction policy: hand-worked examples from its definition, libCacheSim equality on flat traces,
and invariants under random multi-layer traces with prefetching."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from specmd.engine.cache import CacheManager
from specmd.engine.link import TransferChannel
from specmd.engine.simclock import Roofline, SimClock
from specmd.engine.geometry import Geometry
from specmd.policies.eviction import EVICTION
from specmd.policies.miss import MISS


def manager(policy, capacity_experts, layers=1, experts=64, params=None, bw=1e12):
    geom = Geometry(num_layers=layers, num_experts=experts, top_k=1, expert_bytes=100, total_bytes=10**6,
                    dense_params=[0] * layers, attn_layers=[0] * layers, dtype_bytes=2)
    clock = SimClock(geom, TransferChannel(bw, 0.0), Roofline(1e15, 1e15))
    cls = EVICTION.get(policy) if isinstance(policy, str) else policy  # (a name, or a class)
    return CacheManager(geom, [capacity_experts * 100], [cls(params)], MISS.build({"name": "fetch"}), clock)


def flat_hits(policy, trace, capacity, params=None):
    m = manager(policy, capacity, experts=max(trace) + 1, params=params)
    for e in trace:
        m.serve(0, [e])
        m.finish_layer()
        m.check_invariants()
    return m.stats.total("hits")


def lcs_hits(name, trace, capacity, **kw):
    libcachesim = pytest.importorskip("libcachesim")
    cache = getattr(libcachesim, name)(cache_size=capacity, **kw)
    hits = 0
    for e in trace:
        req = libcachesim.Request()
        req.obj_id, req.obj_size = e + 1, 1
        hits += bool(cache.get(req))
    return hits


def zipf_trace(n, universe, seed, s=1.1):
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** s for i in range(universe)]
    return rng.choices(range(universe), weights, k=n)


TRACES = [(zipf_trace(3000, 40, seed), cap) for seed, cap in ((0, 4), (1, 8), (2, 16))]


@pytest.mark.parametrize("trace,capacity", TRACES)
@pytest.mark.parametrize("ours,theirs,params,kw", [
    ("lru", "LRU", None, {}),
    ("fifo", "FIFO", None, {}),
    ("arc", "ARC", None, {}),
    # libCacheSim's LFU counts only while resident; ours does so with history=false
    ("lfu", "LFU", {"history": False}, {}),
    # LeCaR with frozen weights is exactly one of its experts (learning draws random numbers, so only the
    # frozen extremes are comparable hit for hit)
    ("lecar", "LeCaR", {"update_weight": False, "lru_weight": 1.0}, {"update_weight": False, "lru_weight": 1.0}),
    ("lecar", "LeCaR", {"update_weight": False, "lru_weight": 0.0}, {"update_weight": False, "lru_weight": 0.0}),
])
def test_hit_counts_equal_libcachesim(trace, capacity, ours, theirs, params, kw):
    from specmd.registry import build_params

    cls = EVICTION.get(ours)
    p = build_params(getattr(cls, "Params", None), params or {}, ours) if params else None
    assert flat_hits(ours, trace, capacity, p) == lcs_hits(theirs, trace, capacity, **kw)


def test_lecar_learning_tracks_libcachesim_closely():
    trace, cap = TRACES[1]
    ours, theirs = flat_hits("lecar", trace, cap), lcs_hits("LeCaR", trace, cap)
    assert abs(ours - theirs) / theirs < 0.05, (ours, theirs)


def victims(m):
    return [k for k in range(m.geom.num_layers * m.geom.num_experts) if k not in m.entries]


def test_fifo_ignores_hits():
    # capacity 2: 0, 1, 0 (hit), 2 -> FIFO evicts 0 (first in) although it was just used; LRU would evict 1
    m = manager("fifo", 2)
    for e in (0, 1, 0, 2):
        m.serve(0, [e]); m.finish_layer()
    assert sorted(m.entries) == [1, 2]
    m = manager("lru", 2)
    for e in (0, 1, 0, 2):
        m.serve(0, [e]); m.finish_layer()
    assert sorted(m.entries) == [0, 2]


def test_lfu_counts_history_across_evictions():
    # capacity 2: 0,0,1 then 2 evicts 1 (count 1 < 2); 1 again evicts 2 (count 1, ties LRU -> 2 older? no:
    # 1 has history count 2 after re-insert, 2 has 1) -> victim 2; with history=false 1 restarts at 1 and the
    # tie with 2 goes to the least recently used: 2.
    m = manager("lfu", 2)
    for e in (0, 0, 1, 2):
        m.serve(0, [e]); m.finish_layer()
    assert sorted(m.entries) == [0, 2]
    for e in (1, 3):
        m.serve(0, [e]); m.finish_layer()
    # after 1 returns (history count 2) the insert of 3 evicts the least frequent: 3 vs 1 vs 0 -> 3 arrives,
    # victim among {0 (2), 1 (2)} is the least recently used: 0
    assert sorted(m.entries) == [1, 3]


def reading(policy, **params):
    return EVICTION.get(policy).Params(**params)


@pytest.mark.parametrize("counts,left", [("requests", [2, 3]), ("inserts", [0, 3])])
def test_lfu_counts_readings_streamed_misses(counts, left):
    # capacity 2, one layer. {0,1,2}: 0 and 1 inserted, 2 streamed (the call's own experts fill the pool).
    # {0}: hit. {2}: miss, evicts 1 (count 1 < 0's 2). {3}: miss; 0 has 2 counts; 2 has 2 under
    # ``requests`` (the streamed miss and this miss) -> tie, the least recently counted 0 goes; 1 under
    # ``inserts`` (the streamed miss does not count) -> 2 goes.
    m = manager("lfu", 2, experts=4, params=reading("lfu", counts=counts))
    for experts in ([0, 1, 2], [0], [2], [3]):
        m.serve(0, experts); m.finish_layer()
    assert m.stats.total("streamed") == 1
    assert sorted(m.entries) == left


def test_lfu_counts_requests_a_prefetch_is_not_an_access():
    # capacity 2. {0}, {0}: 2 counts. Prefetch 1, then {1} hits it, then {3} misses.
    # A hit on the prefetched expert counts once under requests, twice (insert + hit) under inserts:
    for counts, left in (("requests", [0, 3]), ("inserts", [1, 3])):
        m = manager("lfu", 2, experts=4, params=reading("lfu", counts=counts))
        for _ in range(2):
            m.serve(0, [0]); m.finish_layer()
        m.prefetch(0, [1]); m.clock.compute(1e15, 0)
        m.serve(0, [1]); m.finish_layer()  # 0: 2 counts; 1: 1 (requests) or 2, more recent (inserts)
        m.serve(0, [3]); m.finish_layer()
        assert sorted(m.entries) == left, counts


def test_lfu_in_cache_counts_restart_at_insert():
    # history=false (libCacheSim's LFU), counts=requests, capacity 2.
    # (a) {0,1,2}: 2 streamed (count 1 lingers, never resident); {0}: 0 -> 2; {2}: evicts 1, and 2's count
    # restarts at 1 on insert (not 2); {3}: victim 2 (1 < 0's 2) -> [0, 3] (without the restart: a tie at 2,
    # the least recently counted 0 would go).
    m = manager("lfu", 2, experts=4, params=reading("lfu", history=False))
    for experts in ([0, 1, 2], [0], [2], [3]):
        m.serve(0, experts); m.finish_layer()
    assert sorted(m.entries) == [0, 3]
    # (b) a prefetched copy restarts at 0: {0}, {0}: 0 -> 2; prefetch 1 (0), {1} hits (1); {2}: 1 < 2 -> 1 goes
    m = manager("lfu", 2, experts=4, params=reading("lfu", history=False))
    m.serve(0, [0]); m.finish_layer(); m.serve(0, [0]); m.finish_layer()
    m.prefetch(0, [1]); m.clock.compute(1e15, 0)
    m.serve(0, [1]); m.finish_layer()
    m.serve(0, [2]); m.finish_layer()
    assert sorted(m.entries) == [0, 2]


def test_lfu_never_requested_prefetches_are_least_recent():
    # capacity 3, counts=requests: prefetch 2, then {0}, then prefetch 1: 1 and 2 have 0 counts and no use;
    # neither is more recent than the other (ties: lower key), so {3} evicts 1, not the older prefetch 2.
    m = manager("lfu", 3, experts=4)
    m.prefetch(0, [2]); m.clock.compute(1e15, 0)
    m.serve(0, [0]); m.finish_layer()
    m.prefetch(0, [1]); m.clock.compute(1e15, 0)
    m.serve(0, [3]); m.finish_layer()
    assert sorted(m.entries) == [0, 2, 3]


def test_fld_distance_readings():
    # 4 layers, capacity 3: L0 {0}, L1 {0}, L2 {0}, then L3 {0} misses. From layer 3: forward distances
    # (l - 3) mod 4 are L0: 1, L1: 2, L2: 3 -> evict (2,0); absolute |l - 3| are L0: 3, L1: 2, L2: 1 -> (0,0).
    for params, gone in ((reading("fld", distance="forward"), 2 * 4), (reading("fld", distance="absolute"), 0),
                         (None, 0)):  # the default reading is SpecMD's "distance between ... layers"
        m = manager("fld", 3, layers=4, experts=4, params=params)
        for layer in range(4):
            m.serve(layer, [0]); m.finish_layer()
        assert gone not in m.entries and len(m.entries) == 3, params


def test_fld_absolute_ties_evict_the_left_layer():
    # 5 layers, capacity 4: L0, L1, L3, L4 hold expert 0, then L2 {0} misses. Absolute distances from 2:
    # L0: 2, L4: 2 (tie: the left L0 goes), L1: 1, L3: 1. Forward (l - 2) mod 5: L1: 4 is the furthest.
    for distance, gone in (("absolute", 0), ("forward", 1 * 4)):
        m = manager("fld", 4, layers=5, experts=4, params=reading("fld", distance=distance))
        for layer in (0, 1, 3, 4, 2):
            m.serve(layer, [0]); m.finish_layer()
        assert gone not in m.entries and len(m.entries) == 4, distance


def test_least_stale_keeps_upcoming_layers():
    # capacity 4, 3 layers. Pass 0: L0 {0}, prefetch (2,0) issued at L0, L1 {0}, L2 {1}: insert order
    # (0,0), (2,0), (1,0), (2,1); all stale in pass 1. Pass 1: L0 {1} misses: both evict (0,0).
    # L1 {1} misses: LRU evicts the oldest, (2,0) -- needed by the upcoming layer 2 in the paper's picture;
    # Least-Stale evicts the stale expert of the lowest layer, (1,0) (layer 1's unused expert).
    def run(policy):
        m = manager(policy, 4, layers=3, experts=4)
        m.begin_pass("decode", 1, 1)
        m.serve(0, [0]); m.prefetch(2, [0]); m.finish_layer()
        m.clock.compute(1e15, 0)  # one simulated second: the prefetch has arrived
        m.serve(1, [0]); m.finish_layer()
        m.serve(2, [1]); m.finish_layer()
        m.end_pass()
        m.begin_pass("decode", 1, 2)
        m.serve(0, [1]); m.finish_layer()
        assert 0 not in m.entries
        m.serve(1, [1]); m.finish_layer()
        m.end_pass()
        return sorted(m.entries)

    assert run("lru") == [1, 4, 5, 9]  # keys: (0,1)=1, (1,0)=4, (1,1)=5, (2,1)=9
    assert run("least_stale") == [1, 5, 8, 9]  # (2,0)=8 kept, (1,0) evicted


def _ls_right_only(order):
    # 4 layers, capacity 4. Pass 0: L0 {0} (prefetching (2,0)), L1 {0}, L2 {0} (hit), L3 {0}: the stale
    # queue of pass 1 in joining order is (0,0), (2,0), (1,0), (3,0). Pass 1, L0 requests {0, 1}: (0,0) hits
    # (current again), (0,1) misses; every stale candidate is right of the execution point.
    m = manager("least_stale", 4, layers=4, experts=4, params=reading("least_stale", order=order) if order else None)
    m.begin_pass("decode", 1, 1)
    m.serve(0, [0]); m.prefetch(2, [0]); m.finish_layer()
    m.clock.compute(1e15, 0)  # the prefetch arrives
    for layer in (1, 2, 3):
        m.serve(layer, [0]); m.finish_layer()
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    m.serve(0, [0, 1]); m.finish_layer()
    return ({4, 8, 12} - set(m.entries)).pop()


def _ls_left_layers(order):
    # 3 layers, capacity 5. Pass 0: L0 {0, 1}, L1 {0, 1}, L2 {0}. Pass 1: L0 {1} and L1 {1} hit, then L2 {1}
    # misses: the stale candidates (0,0), (1,0), (2,0) are all left of (or at) the execution point.
    m = manager("least_stale", 5, layers=3, experts=4, params=reading("least_stale", order=order) if order else None)
    m.begin_pass("decode", 1, 1)
    for layer, experts in ((0, [0, 1]), (1, [0, 1]), (2, [0])):
        m.serve(layer, experts); m.finish_layer()
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    for layer in (0, 1, 2):
        m.serve(layer, [1]); m.finish_layer()
    return ({0, 4, 8} - set(m.entries)).pop()


@pytest.mark.parametrize("order,right_only,left_layers", [
    # left_then_right: left layers lowest first, then the right layer furthest ahead: (3,0); (0,0)
    ("left_then_right", 12, 0),
    # layer: lowest layer first: the next layer's (1,0), needed soonest; (0,0)
    ("layer", 4, 0),
    # needed_last: c, c-1, ..., 0, L-1, ..., c+1: (3,0) from layer 0; from layer 2 its own stale (2,0)
    ("needed_last", 12, 8),
    (None, 12, 8),  # the default: needed_last (the paper's measurements decide; see the docstring)
    # insertion: the first to join the queue: (2,0) (prefetched during layer 0); (0,0)
    ("insertion", 8, 0),
])
def test_least_stale_order_readings(order, right_only, left_layers):
    assert _ls_right_only(order) == right_only
    assert _ls_left_layers(order) == left_layers


def test_least_stale_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="order='lifo'; valid: needed_last, left_then_right, layer, insertion"):
        reading("least_stale", order="lifo")


def test_least_stale_current_queue_only_when_nothing_stale():
    # capacity 2, one pass: L0 {0}, L1 {0}, L2 {0}: everything is current; at L2 the victim is the layer
    # needed last (the default reading): L1's (1,0) = 4; left_then_right takes the lowest layer's (0,0) = 0.
    for order, kept in ((None, [0, 8]), ("left_then_right", [4, 8])):
        m = manager("least_stale", 2, layers=3, experts=4, params=reading("least_stale", order=order) if order else None)
        m.begin_pass("prefill", 1, 1)
        for layer in range(3):
            m.serve(layer, [0]); m.finish_layer()
        assert sorted(m.entries) == kept, order


class _Rec:  # what score eviction reads of a gate record: router probabilities [T, E]
    def __init__(self, probs):
        import torch

        self.probs = torch.tensor([probs], dtype=torch.float64)

    def probs_rows(self):  # (GateRecord's: float32 on the host)
        return self.probs.float().numpy()


class _View:  # the read-only cache view, for policies tested without a cache manager
    def __init__(self, bits=None, high_bits=16, experts=4):
        self._bits = bits or {}
        self.high_bits = high_bits
        self.geometry = Geometry(num_layers=1, num_experts=experts, top_k=1, expert_bytes=1, total_bytes=experts)
        self.fetch_precision = "native"

    def bits_of(self, precision):
        return self.high_bits

    def bits(self, key):
        return self._bits.get(key)  # None: not resident (as the real view)


def test_score_policy_mean_over_last_n():
    from specmd.policies.eviction.score import ScoreEviction

    for n, expect in ((1, 1), (2, 3), (8, 3)):
        pol = ScoreEviction(ScoreEviction.Params(n=n))
        pol.attach(_View(), 4)
        for k in range(4):
            pol.on_insert(k, False)
        pol.on_layer(0, _Rec([0.1, 0.4, 0.3, 0.2]))
        pol.on_layer(0, _Rec([0.5, 0.1, 0.3, 0.2]))
        # n=1: last = [.5,.1,.3,.2] -> 1, then 3; n>=2: mean = [.3,.25,.3,.2] -> 3, then 1
        assert pol.victim(lambda k: True) == expect
        assert pol.victim(lambda k: k != expect) == {1: 3, 3: 1}[expect]


@pytest.mark.parametrize("unit,n,after_prefill,after_decode", [
    ("token", 1, 1, 0), ("call", 1, 3, 0), ("token", 3, 3, 3), ("call", 2, 3, 0)])
def test_score_policy_unit_readings(unit, n, after_prefill, after_decode):
    # A prefill call of two tokens [.1,.4,.3,.2], [.5,.1,.3,.2] (mean [.3,.25,.3,.2]), then a decode token
    # [.05,.35,.4,.2]. ``token``: each token is a step; ``call``: a call is one step, its mean over tokens.
    # After the prefill: token n=1 sees the last token -> 1; call n=1 the mean -> 3; token n=3 both tokens
    # -> 3; call n=2 the mean -> 3. After the decode: token/call n=1 see [.05,...] -> 0; token n=3 the mean
    # of three tokens [.2167,.2833,.3333,.2] -> 3; call n=2 the mean of two steps [.175,.3,.35,.2] -> 0.
    import torch

    from specmd.policies.eviction.score import ScoreEviction

    class Rec(_Rec):
        def __init__(self, rows):
            self.probs = torch.tensor(rows, dtype=torch.float64)

    pol = ScoreEviction(ScoreEviction.Params(n=n, unit=unit))
    pol.attach(_View(), 4)
    for k in range(4):
        pol.on_insert(k, False)
    pol.on_layer(0, Rec([[0.1, 0.4, 0.3, 0.2], [0.5, 0.1, 0.3, 0.2]]))
    assert pol.victim(lambda k: True) == after_prefill
    pol.on_layer(0, Rec([[0.05, 0.35, 0.4, 0.2]]))
    assert pol.victim(lambda k: True) == after_decode


def test_score_policy_end_to_end_uses_router_probabilities():
    import torch

    from specmd.engine.record import LiveRecord, Scoring

    m = manager("score", 2, experts=4)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    for e in (3, 2):
        rec = LiveRecord(0, logits, None, torch.tensor([[e]]), Scoring(False, False, 1.0))
        m.serve(0, [e], rec); m.finish_layer()
    rec = LiveRecord(0, logits, None, torch.tensor([[0]]), Scoring(False, False, 1.0))
    m.serve(0, [0], rec)  # full: evicts the lower-scored resident, expert 2 (0.3 < 0.4)
    assert sorted(m.entries) == [0, 3]


@pytest.mark.parametrize("start,victim", [("mean", 0), ("zero", 3), (None, 0)])
def test_score_policy_start_readings(start, victim):
    # Experts 0, 1, 2 resident when layer 0 scores [.1, .4, .3, .2]; then 3 joins. ``mean`` (the default):
    # 3 starts at its layer's window mean 0.2, so 0 (0.1) goes; ``zero``: 3 starts at 0 and goes first.
    from specmd.policies.eviction.score import ScoreEviction

    pol = ScoreEviction(ScoreEviction.Params(start=start) if start else None)
    pol.attach(_View(), 4)
    for k in range(3):
        pol.on_insert(k, False)
    pol.on_layer(0, _Rec([0.1, 0.4, 0.3, 0.2]))
    pol.on_insert(3, True)
    assert pol.victim(lambda k: True) == victim


@pytest.mark.parametrize("value,kept", [("probs", [1, 4]), ("logits", [0, 1]), (None, [1, 4])])
def test_score_policy_value_readings(value, kept):
    # Two layers; layer 0's router adds 10 to every logit (softmax does not see it). Resident (0,0) with
    # probability .1 (logit ~7.7) and (1,0) with probability .4 (logit ~-0.9); layer 0 then asks for expert 1:
    # ``probs`` evicts (0,0), ``logits`` evicts (1,0), whose raw logit is lower.
    import torch

    from specmd.engine.record import LiveRecord, Scoring

    params = reading("score", value=value) if value else None
    m = manager("score", 2, layers=2, experts=4, params=params)
    l0 = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])) + 10
    l1 = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    m.begin_pass("decode", 1, 1)
    for layer, logits in ((0, l0), (1, l1)):
        m.serve(layer, [0], LiveRecord(layer, logits, None, torch.tensor([[0]]), Scoring(False, False, 1.0)))
        m.finish_layer()
    m.end_pass()
    m.begin_pass("decode", 1, 2)
    m.serve(0, [1], LiveRecord(0, l0, None, torch.tensor([[1]]), Scoring(False, False, 1.0)))
    assert sorted(m.entries) == kept


@pytest.mark.parametrize("n,value", [(1, "probs"), (3, "logits"), (8, "probs"), (5, "logits")])
def test_score_window_means_and_ranks_are_numpys(n, value):
    """The window (a ring of the last n steps, re-summed oldest first) has the bits of numpy's
    ``window.sum(0) / len(window)`` over every step so far, and the victim is the resident key with the lowest
    mean (ties: lower key), negative logits, -0.0 and exact ties included (the heap's integer ranks order as the
    scores do)."""
    import numpy as np
    import torch

    from specmd.policies.eviction.score import ScoreEviction

    class Rec(_Rec):
        def __init__(self, rows):
            self.probs = self.logits = torch.tensor(rows, dtype=torch.float32)

    rng = np.random.default_rng(n)
    E = 6
    pol = ScoreEviction(ScoreEviction.Params(n=n, value=value))
    pol.attach(_View(experts=E), E)
    for k in range(E):
        pol.on_insert(k, False)
    rows = []
    for step in range(40):
        T = int(rng.integers(1, 4))
        r = np.where(rng.random((T, E)) < 0.5, rng.choice([-2.5, -1.0, -0.0, 0.0, 0.25, 3.0], size=(T, E)),
                     rng.standard_normal((T, E)) * 10.0 ** rng.integers(-12, 4, (T, E))).astype(np.float32)
        # (exact ties, and magnitudes far apart: float32 values whose double sums round, so the order shows)
        if value == "probs":
            r = np.abs(r)
        rows += list(r)
        pol.on_layer(0, Rec(r))
        window = np.array(rows[-n:], dtype=np.float64)
        want = window.sum(0) / len(window)
        assert np.array_equal(pol.mean[0], want) and np.array_equal(pol.history[0], window)
        evictable = set(rng.choice(E, size=3, replace=False).tolist())
        best = min(evictable, key=lambda k: (want[k], k))
        assert pol.victim(lambda k: k in evictable) == best, (step, want)


def test_score_policy_rejects_unknown_readings():
    with pytest.raises(ValueError, match="start='one'; valid: mean, zero"):
        reading("score", start="one")
    with pytest.raises(ValueError, match="value='gates'; valid: probs, logits"):
        reading("score", value="gates")


def test_lhu_counts_only_high_precision_uses():
    from specmd.policies.eviction.lhu import LHU

    pol = LHU(None)
    pol.attach(_View({0: 16, 1: 4, 2: 16}, high_bits=16), 3)
    for k in (0, 1, 2):
        pol.on_insert(k, False)
    for _ in range(3):
        pol.on_access(1)  # three low-precision uses: still 0 high-precision uses
    pol.on_access(2)
    # high-precision counts: 0 -> 1, 1 -> 0, 2 -> 2: LHU evicts 1 although LFU would evict 0
    assert pol.victim(lambda k: True) == 1


class _QuantView(_View):
    def __init__(self, bits):
        super().__init__(bits)
        self.fetch_precision = "int8"
        self.precisions = ["native", "int8"]  # (LHU's shortcut reads them: all high under ``fetch`` only)

    def bits_of(self, precision):
        return {"native": 16, "int8": 8}[precision]


@pytest.mark.parametrize("high,victim", [("fetch", 1), ("native", 0)])
def test_lhu_high_precision_readings(high, victim):
    # copies: 0 at int8 (the fetch precision), 1 native. 0 is used three times, 1 once. ``fetch``: every
    # use of an int8-or-better copy counts (0: 3, 1: 1 -> evict 1); ``native``: only native copies count
    # (0: 0, 1: 1 -> evict 0).
    from specmd.policies.eviction.lhu import LHU

    pol = LHU(LHU.Params(high=high))
    pol.attach(_QuantView({0: 8, 1: 16}), 2)
    pol.on_insert(0, False)
    pol.on_insert(1, False)
    pol.on_access(0)
    pol.on_access(0)
    assert pol.victim(lambda k: True) == victim


@pytest.mark.parametrize("policy", ["arc", "lecar"])
@pytest.mark.parametrize("unit,c", [("fetch", 8), ("native", 4)])
def test_adaptive_policies_capacity_unit_readings(policy, unit, c):
    # a 400-byte pool, native experts of 100 bytes, the miss policy fetching int4 copies of 50 bytes
    class View(_View):
        def __init__(self):
            super().__init__()
            self.fetch_precision = "int4"
            self.geometry = Geometry(num_layers=1, num_experts=16, top_k=1, expert_bytes=100, total_bytes=1600)

        def bytes_of(self, precision):
            return {"native": 100, "int4": 50}[precision]

    cls = EVICTION.get(policy)
    pol = cls(cls.Params(capacity_unit=unit))
    pol.attach(View(), 400)
    assert pol.c == c
    with pytest.raises(ValueError, match="capacity_unit='bytes'; valid: fetch, native"):
        cls.Params(capacity_unit="bytes")


@pytest.mark.parametrize("high,count", [("fetch", 1), ("native", 0)])
def test_lhu_counts_requests_weighs_a_miss_by_the_fetch_precision(high, count):
    # counts=requests: a miss of a non-resident expert counts as a use at the fetch precision (int8 here),
    # high precision under ``fetch``, not under ``native``
    from specmd.policies.eviction.lhu import LHU

    pol = LHU(LHU.Params(counts="requests", high=high))
    pol.attach(_QuantView({}), 2)
    pol.on_miss(5)
    assert pol.count[5] == count
    assert pol.miss_hook() is not None and LHU(LHU.Params()).miss_hook() is None  # inserts: no call per miss


def test_arc_adapts_p_on_ghost_hits():
    # c = 2. 0, 0 (hit: T2 = [0]), 1 (T1 = [1]); 2: case IV(b), REPLACE evicts T1's LRU (|T1| = 1 > p = 0):
    # B1 = [1]. 1 again: ghost hit in B1 -> p = 0 + max(|B2|/|B1|, 1) = 1 and 1 enters T2.
    # (0, 1, 2 instead would be case IV(a) with B1 empty: 0 leaves without a ghost, as in the paper.)
    m = manager("arc", 2)
    pol = m.pools[0].policy
    for e in (0, 0, 1, 2):
        m.serve(0, [e]); m.finish_layer()
    assert list(pol.b1) == [1] and pol.p == 0
    m.serve(0, [1]); m.finish_layer()
    assert pol.p == 1.0 and 1 in pol.t2
    m2 = manager("arc", 2)
    for e in (0, 1, 2):
        m2.serve(0, [e]); m2.finish_layer()
    assert not m2.pools[0].policy.b1 and sorted(m2.entries) == [1, 2]


def test_lecar_weight_update_on_history_hit():
    import math

    m = manager("lecar", 2, params=EVICTION.get("lecar").Params(lru_weight=1.0))
    pol = m.pools[0].policy
    for e in (0, 0, 1, 2):  # 2: LRU names 0, LFU names 1 (count 1 < 2); w_lru = 1 evicts 0 -> LRU's history
        m.serve(0, [e]); m.finish_layer()
    assert 0 in pol.hist_lru
    m.serve(0, [0]); m.finish_layer()  # time 4: LRU erred -> w_lfu = 0 * e^... stays 0 -> renormalised 1.0
    assert pol.w_lru == 1.0
    pol.w_lru = 0.5
    pol.hist_lru[7] = pol.time
    pol.on_admit(7)
    d = 0.005 ** (1 / 2)
    w_lfu = 0.5 * math.exp(0.45 * d ** 1)
    assert pol.w_lru == pytest.approx(0.5 / (0.5 + w_lfu))


@pytest.mark.parametrize("policy", [p for p in EVICTION.names() if not EVICTION.get(p).needs_future])  # belady: test_replay
@settings(max_examples=25, deadline=None)
@given(data=hs.data())
def test_invariants_random_traces(policy, data):
    layers, experts = 4, 8  # 4 MoE layers: the shipped ml weights' layer count
    cap = data.draw(hs.integers(1, 10))
    m = manager(policy, cap, layers=layers, experts=experts, bw=5e4)
    for p in range(data.draw(hs.integers(1, 4))):
        m.begin_pass("decode" if p else "prefill", 1, p + 1)
        for layer in range(layers):
            req = sorted(set(data.draw(hs.lists(hs.integers(0, experts - 1), min_size=1, max_size=4))))
            m.clock.dense(layer, 1, p + 1)
            m.serve(layer, req)
            if layer + 1 < layers:
                m.prefetch(layer + 1, data.draw(hs.lists(hs.integers(0, experts - 1), max_size=4, unique=True)))
            m.clock.experts(len(req), len(req))
            m.finish_layer()
            m.check_invariants()
            assert m.used_bytes <= cap * 100
        m.end_pass()
    st = m.stats
    assert st.total("hits") + st.total("misses") == st.total("requests")


def test_ml_features_match_flashmoe_definition():
    import numpy as np

    from specmd.policies.eviction.ml import features

    # step 5: expert 0 routed at step 5 (r = 1), expert 1 at step 2 (r = 4), expert 2 never; counts 3, 1, 0
    x = features(np.array([5, 2, -1]), np.array([3.0, 1.0, 0.0]), 5)
    assert x.ravel().tolist() == pytest.approx([1.0, 1.0, 0.25, 1 / 3, 0.0, 0.0])


def test_ml_policy_evicts_largest_predicted_distance(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    # A hand-set network: distance = 1 - 1/r (ReLU-free path: w3 reads hidden unit 0, which is SiLU(SiLU(-x0)+...))
    # Simpler: make the output linear in 1/r by tiny weights (SiLU(z) ~ z/2 near 0): predicted ~ -c * (1/r)
    w1 = np.zeros((128, 2), np.float32); w1[0, 0] = 1e-3
    w2 = np.zeros((128, 128), np.float32); w2[0, 0] = 1.0
    w3 = np.zeros((1, 128), np.float32); w3[0, 0] = -1.0
    t = {}
    for l in range(2):
        t.update({f"layer{l}.w1": w1, f"layer{l}.b1": np.zeros(128, np.float32), f"layer{l}.w2": w2,
                  f"layer{l}.b2": np.zeros(128, np.float32), f"layer{l}.w3": w3, f"layer{l}.b3": np.zeros(1, np.float32)})
    path = tmp_path / "ml.safetensors"
    save_file(t, str(path), metadata={"num_layers": "2"})
    m = manager("ml", 3, layers=2, experts=4, params=EVICTION.get("ml").Params(weights=str(path)))
    # layer 0 steps: {0}, {1}, {2}: recency of 0 is 3, of 1 is 2, of 2 is 1 -> the stalest (0) has the
    # largest predicted distance -> evicted when 3 arrives
    for e in (0, 1, 2):
        m.serve(0, [e]); m.finish_layer()
    m.serve(0, [3]); m.finish_layer()
    assert sorted(m.entries) == [1, 2, 3]


def _hand_ml(tmp_path, column: int, layers: int = 1):
    """A hand-set network whose predicted distance falls as input ``column`` rises (0: 1/r, 1: f/max f):
    distance = -SiLU(SiLU(1e-3 * x[column])), monotone, so the order is the feature's."""
    import numpy as np
    from safetensors.numpy import save_file

    w1 = np.zeros((128, 2), np.float32); w1[0, column] = 1e-3
    w2 = np.zeros((128, 128), np.float32); w2[0, 0] = 1.0
    w3 = np.zeros((1, 128), np.float32); w3[0, 0] = -1.0
    t = {}
    for l in range(layers):
        t.update({f"layer{l}.w1": w1, f"layer{l}.b1": np.zeros(128, np.float32), f"layer{l}.w2": w2,
                  f"layer{l}.b2": np.zeros(128, np.float32), f"layer{l}.w3": w3, f"layer{l}.b3": np.zeros(1, np.float32)})
    path = tmp_path / f"ml{column}.safetensors"
    save_file(t, str(path), metadata={"num_layers": str(layers)})
    return EVICTION.get("ml").Params(weights=str(path))


def test_ml_counts_every_routed_request_as_a_use(tmp_path):
    """FlashMoE Algorithm 1: f counts the times an expert was *routed*, whatever the cache did. A request
    streamed because the call's own experts fill the pool is a use too (counting uses at the insert, as
    this policy once did, leaves expert 2 below at f = 1 and evicts it instead of expert 1)."""
    m = manager("ml", 2, experts=4, params=_hand_ml(tmp_path, column=1))  # evicts the least frequent
    for _ in range(3):  # 0 and 1 fill the 2 slots; 2 is streamed every time
        m.serve(0, [0, 1, 2]); m.finish_layer()
    assert sorted(m.entries) == [0, 1] and m.stats.total("streamed") == 3
    m.serve(0, [2]); m.finish_layer()  # f: 0 -> 3, 1 -> 3, 2 -> 4; the tie 0/1 goes to the lower key
    assert sorted(m.entries) == [1, 2]
    m.serve(0, [3]); m.finish_layer()  # f(1) = 3 < f(2) = 4: 1 is evicted
    assert sorted(m.entries) == [2, 3]


def test_ml_network_rows_are_the_trained_network_and_the_training_features():
    """ML scores one row at a time in float64: its features are ``features``' (the training set's, float32) and
    its distance is the trained network's (torch's float32 forward, to float32 precision; a float64 forward
    of the same weights, to 1e-12), on every shipped network and on inputs of every kind (never routed,
    r = 1, f = 0, the layer's most frequent)."""
    import numpy as np
    import torch

    from specmd.policies.eviction.ml import ML, features, load_networks

    silu = torch.nn.functional.silu
    rng = np.random.default_rng(0)
    for asset in ("tiny-olmoe", "deep-mixtral"):
        nets, _ = load_networks(f"specmd:{asset}")
        E = 16
        pol = ML(ML.Params(weights=f"specmd:{asset}"))
        pol._shape(nets, E)  # (what attach does with a model of the networks' layers and E experts)
        for layer in range(min(4, len(nets))):
            step = int(rng.integers(1, 50))
            last = rng.integers(-1, step + 1, E)
            freq = np.where(last >= 0, rng.integers(1, 9, E), 0).astype(float)
            pol.step[layer], pol.fmax[layer] = step, freq.max()
            for e in range(E):
                pol.last[layer, e], pol.freq[layer, e] = last[e], freq[e]
            x = features(last, freq, step)
            assert [pol.row(layer, e) for e in range(E)] == [tuple(r) for r in x.tolist()]
            got = np.array([pol.distance(layer, e) for e in range(E)])
            w = {k: torch.from_numpy(v) for k, v in nets[layer].items()}
            ref32 = torch.nn.functional.linear(silu(torch.nn.functional.linear(silu(torch.nn.functional.linear(
                torch.from_numpy(x), w["w1"], w["b1"])), w["w2"], w["b2"])), w["w3"], w["b3"])[:, 0].numpy()
            w64 = {k: v.double() for k, v in w.items()}
            x64 = torch.from_numpy(x).double()
            ref64 = torch.nn.functional.linear(silu(torch.nn.functional.linear(silu(torch.nn.functional.linear(
                x64, w64["w1"], w64["b1"])), w64["w2"], w64["b2"])), w64["w3"], w64["b3"])[:, 0].numpy()
            assert np.allclose(got, ref64, rtol=1e-12, atol=1e-12), (asset, layer)
            assert np.allclose(got, ref32, rtol=1e-5, atol=1e-6), (asset, layer)


def _ml_reference(pol, layer: int) -> float:
    """ML's network on ``pol``'s features, as the source reads: Python floats, ``math.exp``, every sum in input
    order (h2 = b2, then each input's row added in turn)."""
    import math

    import numpy as np

    H = pol.H
    w1, w2, w3 = (np.asarray(a).tolist() for a in (pol._w1, pol._w2, pol._w3))
    b1, b2 = (np.asarray(a).tolist() for a in (pol._b1, pol._b2))
    x0, x1 = float(pol._x[0]), float(pol._x[1])
    o1, ob, o2 = layer * 2 * H, layer * H, layer * H * H
    silu = lambda z: z / (1.0 + math.exp(-z)) if z > -700.0 else 0.0  # noqa: E731
    h1 = [silu(b1[ob + j] + x0 * w1[o1 + j] + x1 * w1[o1 + H + j]) for j in range(H)]
    h2 = [b2[ob + j] for j in range(H)]
    for i in range(H):
        for j in range(H):
            h2[j] += h1[i] * w2[o2 + i * H + j]
    out = float(pol._b3[layer])
    for j in range(H):
        if h2[j] > -700.0:
            out += silu(h2[j]) * w3[ob + j]
    return out


def test_ml_network_bits_are_the_same_compiled_and_as_source():
    """ML's network is one arithmetic (``ML._forward``: C loops compiled, the same loops run as source): its
    distances equal, bit for bit, Python floats summed in the source's order, on every shipped network, on
    features of every kind and on large and negative pre-activations (SiLU's exp cut-off included)."""
    import numpy as np

    from specmd import native
    from specmd.policies.eviction.ml import ML, load_networks

    if native.loaded("specmd.policies.eviction.ml") != "compiled":
        pytest.skip("as source, ML's network is this reference itself")
    rng = np.random.default_rng(1)
    for asset in ("tiny-olmoe", "deep-mixtral"):
        nets, _ = load_networks(f"specmd:{asset}")
        nets = nets + [{k: (v * 400).astype(np.float32) for k, v in nets[0].items()}]  # |z| beyond the cut-off
        pol = ML(ML.Params(weights=f"specmd:{asset}"))
        pol._shape(nets, 8)
        for layer in range(len(nets)):
            for _ in range(1):
                pol.step[layer] = step = int(rng.integers(1, 60))
                for e in range(8):
                    pol.last[layer, e] = int(rng.integers(-1, step + 1))
                    pol.freq[layer, e] = float(rng.integers(0, 9))
                pol.fmax[layer] = max(pol.freq[layer, e] for e in range(8))
                for e in range(8):
                    got = pol.distance(layer, e)
                    assert got == _ml_reference(pol, layer), (asset, layer, e)


def test_ml_victims_equal_rescoring_from_scratch():
    """Every victim ML picks equals the one found by re-scoring every candidate's features at that moment:
    the cached predictions are never stale (an expert used since they were computed is re-scored)."""
    import random

    from specmd.policies.eviction.ml import ML

    checked = {"n": 0}

    class Checking(ML):
        def victim(self, evictable):
            return checking_victim(self, evictable)

    def checking_victim(self, evictable):
        got = ML.victim(self, evictable)
        best, best_key = None, None
        for key in self._heap.keys():
            if not evictable(key):
                continue
            layer, e = divmod(key, self.E)
            v = self.distance(layer, e)  # (its features now)
            if best is None or v > best or (v == best and key < best_key):
                best, best_key = v, key
        assert got == best_key
        checked["n"] += 1
        return got

    rng = random.Random(0)
    layers, experts = 4, 8  # the shipped tiny-olmoe networks: 4 layers
    m = manager(Checking, 6, layers=layers, experts=experts, bw=5e4)
    for p in range(25):  # (~290 searches; each re-scores its candidates: slow as pure Python)
        m.begin_pass("decode", 1, p + 1)
        for layer in range(layers):
            m.clock.dense(layer, 1, p + 1)
            req = sorted(rng.sample(range(experts), 2))
            m.serve(layer, req)
            if layer + 1 < layers:
                m.prefetch(layer + 1, rng.sample(range(experts), 2))
            m.clock.experts(len(req), len(req))
            m.finish_layer()
        m.end_pass()
    assert checked["n"] > 250, checked


@pytest.mark.parametrize("change,match", [
    (lambda t: t.pop("layer1.b2"), "no tensor layer1.b2"),
    (lambda t: t.__setitem__("layer0.w2", t["layer0.w2"][:, :64]), r"layer 0: tensor shapes .*'w2': \(128, 64\)"),
    (lambda t: t["layer1.w3"].__setitem__((0, 5), float("nan")), "layer 1: non-finite values"),
    (lambda t: t["layer0.b1"].__setitem__(3, float("inf")), "layer 0: non-finite values")])
def test_ml_rejects_malformed_weights(tmp_path, change, match):
    """A network file with a missing tensor, a wrong shape or a non-finite weight is a ConfigError naming the
    layer and what is wrong (the C evaluation reads the arrays unchecked)."""
    from safetensors.numpy import save_file

    from specmd.errors import ConfigError
    from specmd.policies.eviction.ml import load_networks

    nets, _ = load_networks("specmd:tiny-olmoe")
    tensors = {f"layer{l}.{k}": v.copy() for l, net in enumerate(nets[:2]) for k, v in net.items()}
    change(tensors)
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={"num_layers": "2"})
    with pytest.raises(ConfigError, match=match):
        load_networks(str(tmp_path / "bad.safetensors"))


def test_ml_rejects_mismatched_weights():
    from specmd.errors import ConfigError

    with pytest.raises(ConfigError, match="4 layers"):
        manager("ml", 3, layers=2, experts=64)  # the shipped tiny-olmoe networks have 4 layers


def test_shipped_ml_weights_beat_lru_on_held_out_routing():
    import json

    from safetensors import safe_open

    from specmd.models.loader import ASSETS

    with safe_open(str(ASSETS / "tiny-olmoe" / "ml_eviction.safetensors"), "np") as f:
        meta = f.metadata()
    rates = json.loads(meta["holdout_hit_rate"])
    assert rates["ml"] > rates["lru"] and rates["ml"] <= rates["belady"]
    assert int(meta["num_layers"]) == 4


def test_train_eviction_steps_are_layer_calls_and_holdout_rates_are_a_replays(tmp_path):
    """train_eviction has one producer per number: labels along each layer's calls (a prefill call is one
    step, as eviction=ml counts it), and held-out hit rates that a replay of the held-out routing by the
    replay driver -- here a separate `python -m specmd` replay of the same tokens -- reproduces exactly."""
    import json
    import subprocess
    import sys

    import numpy as np
    from safetensors import safe_open

    from specmd.engine.store import StoreSizes
    from specmd.replay.trace import Trace, TraceMeta
    from specmd.commands.train_eviction import dataset, layer_steps, main

    # Belady labels on a hand trace (E = 3, k = 1): 0, 1, 0, 2 -> at t=0 expert 0 is next used at t=2 (d=2)
    x, y = dataset(np.array([[0], [1], [0], [2]]), 3, cap=4)
    y = y.reshape(4, 3)
    assert list(y[0]) == pytest.approx([2 / 4, 1 / 4, 3 / 4])  # 0 at t=2, 1 at t=1, 2 at t=3
    assert list(y[3]) == pytest.approx([1.0, 1.0, 1.0])  # never used again
    # a 3-token prefill then a decode token: the prefill is ONE step of each layer (its experts' union)
    geom = Geometry(num_layers=2, num_experts=4, top_k=1, expert_bytes=1, total_bytes=8)
    tr = Trace(meta=TraceMeta(geometry=geom, store=StoreSizes(16, 1, {})), passes=np.array([[0, 3, 3], [1, 1, 4]]),
               calls=np.array([[0, 0, 0, 3], [0, 1, 3, 3], [1, 0, 6, 1], [1, 1, 7, 1]]),
               index=np.array([[0], [1], [0], [2], [2], [3], [1], [3]]))
    steps = layer_steps(tr)
    assert [[list(e) for e in layer] for layer in steps] == [[[0, 1], [1]], [[2, 3], [3]]]

    rng = np.random.default_rng(0)
    seqs = [[sorted(rng.choice(8, 2, replace=False).tolist()) for _ in range(2 * 30)] for _ in range(10)]
    records = [{"seq": q, "token": t, "layer": l, "experts": seqs[q][2 * t + l]}
               for q in range(10) for t in range(30) for l in range(2)]
    full, last = tmp_path / "all.jsonl", tmp_path / "last.jsonl"
    full.write_text("".join(json.dumps(r) + "\n" for r in records))
    last.write_text("".join(json.dumps(r) + "\n" for r in records if r["seq"] == 9))
    out = tmp_path / "ml.safetensors"
    main(["--traces", str(full), "--format", "jsonl", "--num-experts", "8", "--out", str(out), "--steps", "20",
          "--batch", "256", "--eval-capacity", "4"])  # 300 passes (one per token): the last 30 are held out
    with safe_open(str(out), "np") as f:
        stored = json.loads(f.metadata()["holdout_hit_rate"])
    assert stored["passes"] == [[270, 300]] and stored["capacity_per_layer"] == 4
    assert stored["lru"] <= stored["belady"] and stored["ml"] <= stored["belady"]
    sweep = tmp_path / "sweep"
    for evictions in (["eviction=lru,lfu,belady"], ["eviction=ml", f"eviction.weights={out}"]):
        r = subprocess.run([sys.executable, "-m", "specmd", "-m", f"replay.trace={last}", "replay.format=jsonl",
                            "replay.num_experts=8", *evictions, "hardware.experts_per_layer=4",
                            "hardware.scope=per_layer", "prefetch=none", "logger=none",
                            f"hydra.sweep.dir={sweep}/{len(evictions)}"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    replayed = {}
    for res in sweep.glob("*/*/results.json"):
        res = json.loads(res.read_text())
        replayed[res["config"]["eviction"]["name"]] = round(res["cache"]["hit_rate"], 4)
    assert replayed == {k: stored[k] for k in ("lru", "lfu", "ml", "belady")}
    m = manager("ml", 4, layers=2, experts=8, params=EVICTION.get("ml").Params(weights=str(out)))
    for e in range(8):
        m.serve(1, [e]); m.finish_layer()
        m.check_invariants()


def test_key_lists_keep_dicts_orders_through_random_operations():
    """KeyLists (FIFO, LRU, FLD, Least-Stale): each list keeps the order an insertion-ordered dict keeps
    (append, delete, delete-and-append for a move, ``update`` + ``clear`` for a splice), a key in one list at
    a time, through 20,000 random operations that grow the arrays past their first size; ``first`` is the
    first accepted key from a list's front; a key listed twice, removed unlisted or negative is an error,
    never a silent corruption."""
    import random

    from specmd.policies.eviction.structures import KeyLists

    rng = random.Random(1)
    lists, models = KeyLists(3, keys=4), [{}, {}, {}]
    where = {}
    for step in range(20000):
        key, lst, op = rng.randrange(300), rng.randrange(3), rng.random()
        if op < 0.01:  # splice a whole list onto another
            src, dst = rng.sample(range(3), 2)
            lists.splice(src, dst)
            for k in models[src]:
                where[k] = dst
            models[dst].update(models[src])
            models[src].clear()
        elif key not in where:
            lists.push_back(key, lst)
            models[lst][key] = None
            where[key] = lst
        elif op < 0.4:
            lists.remove(key)
            del models[where.pop(key)][key]
        else:
            lists.move_back(key, lst)
            del models[where[key]][key]
            models[lst][key] = None
            where[key] = lst
        if step % 97 == 0:
            for i in range(3):
                assert lists.keys(i) == list(models[i]) and lists.size(i) == len(models[i])
                assert lists.front(i) == next(iter(models[i]), -1)
                pinned = set(rng.sample(range(300), 150))
                assert lists.first(i, lambda k: k not in pinned) == next((k for k in models[i] if k not in pinned), None)
            assert all(lists.owner(k) == where.get(k, -1) for k in range(-2, 310))
    some = next(iter(where))
    with pytest.raises(KeyError):
        lists.push_back(some, 0)
    with pytest.raises(KeyError):
        lists.remove(next(k for k in range(300) if k not in where))
    with pytest.raises(IndexError):
        lists.push_back(-1, 0)
    with pytest.raises(KeyError):
        lists.remove(-1)
    assert [lists.keys(i) for i in range(3)] == [list(m) for m in models]


def test_key_heap_ranks_like_sorted_tuples_through_random_operations():
    """KeyHeap (LFU, LHU): the heap's order is ``sorted((p1, p2, key))`` of its keys through 20,000 random
    sets, re-ranks, discards and removes that grow the arrays past their first size; ``first`` is the smallest
    accepted key and leaves every key in place; a negative key, or removing an absent one, is an error."""
    import random

    from specmd.policies.eviction.structures import KeyHeap

    rng = random.Random(2)
    heap, model = KeyHeap(keys=4), {}
    for step in range(20000):
        key, op = rng.randrange(300), rng.random()
        if op < 0.15:
            heap.discard(key)
            model.pop(key, None)
        elif op < 0.3:  # remove: the key must be there
            if key in model:
                heap.remove(key)
                del model[key]
            else:
                with pytest.raises(KeyError):
                    heap.remove(key)
        else:
            rank = (rng.randrange(20), rng.randrange(20))  # (ties: the key decides)
            heap.set(key, *rank)
            model[key] = rank
        if step % 97 == 0:
            order = sorted(model, key=lambda k: (*model[k], k))
            assert heap.keys() == order and len(heap) == len(model)
            pinned = set(rng.sample(range(300), 150))
            assert heap.first(lambda k: k not in pinned) == next((k for k in order if k not in pinned), None)
            assert heap.keys() == order  # (the keys set aside are back)
            assert all(heap.contains(k) == (k in model) for k in range(-2, 310))
    assert heap.first(lambda k: False) is None and len(heap) == len(model)
    with pytest.raises(IndexError):
        heap.set(-1, 0, 0)


def test_key_lists_and_layer_queues_reject_a_list_or_layer_out_of_range():
    """In the compiled build these index arrays without bounds checks: a list or a layer out of range must be
    an error before any array is touched (in both builds alike), never a read past the end."""
    from specmd.policies.eviction.structures import KeyLists, LayerQueues

    lists = KeyLists(3)
    for lst in (-1, 3):
        with pytest.raises(IndexError):
            lists.push_back(1, lst)
        with pytest.raises(IndexError):
            lists.first(lst, lambda k: True)
        with pytest.raises(IndexError):
            lists.keys(lst)
    assert [lists.keys(i) for i in range(3)] == [[], [], []]
    queues = LayerQueues(2, lambda current, n: [current, 2])  # a user's order naming layer 2 of 0..1
    queues.add(0, 1)
    with pytest.raises(ValueError, match="outside 0..1"):
        queues.first(0, lambda k: True)


def test_a_subclass_of_a_compiled_policy_keeps_its_own_params_and_fails_cleanly_without_init():
    """A Python subclass of a built-in policy gets its own ``Params`` defaults; one that skips the base's
    ``__init__`` never crashes the process: compiled, its typed fields are unset, and the build's None and
    initialisation checks (or, in ``ml``, the typed array every hook reads first) raise; as source it gets an
    AttributeError. Every hook of each, on a fresh instance in a subprocess."""
    import subprocess
    import sys
    from dataclasses import dataclass

    from specmd.policies.eviction.arc import ARC

    @dataclass
    class MyParams:
        capacity_unit: str = "native"

    class MyARC(ARC):
        Params = MyParams

    assert MyARC().params == MyParams()
    code = """
from specmd.policies.eviction import EVICTION
classes = [type("Skip", (EVICTION.get(n),), {"__init__": lambda self: None}) for n in EVICTION.names()]
calls = [lambda p: p.on_insert(3, False), lambda p: p.on_access(3), lambda p: p.on_remove(3),
         lambda p: p.victim(lambda k: True), lambda p: p.on_miss(3), lambda p: p.on_layer(0)]
for cls in classes:
    for call in calls:
        try:
            call(cls())
            print("ran")
        except (AttributeError, TypeError, ValueError, ZeroDivisionError, KeyError, IndexError) as e:
            print(type(e).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]  # (a crash: a negative return code, a signal)
    assert len(out.stdout.split()) == 6 * len(EVICTION.names())
