"""Hand-worked examples for routing, miss and prefetch policies (from the papers' definitions) and the
quantized expert store."""


import pytest
import torch

from specmd.compose import spec_of
from specmd.engine.record import LiveRecord, Scoring
from specmd.errors import ConfigError
from specmd.policies.miss import MISS
from specmd.policies.prefetch import PREFETCH
from specmd.policies.routing import ROUTING
from specmd.policies.routing.base import promote_select

SOFTMAX = Scoring(False, False, 1.0)


class FakeCache:
    """What routing/miss policies read from the cache view (and its clock view)."""

    def __init__(self, present=(), resident=None, host=1.0, transfer=1.0):
        from types import SimpleNamespace

        self._present = list(present)
        self._resident = list(present if resident is None else resident)
        self.clock = SimpleNamespace(host_time=lambda slots, experts: host * slots,
                                     transfer_time=lambda precision=None: transfer)

    def present(self, layer):
        return self._present

    def resident(self, layer):
        return self._resident


def record(probs, k, layer=0, index=None):
    probs = torch.tensor(probs, dtype=torch.float32)
    logits = probs.log()
    if index is None:
        index = probs.topk(k, dim=-1).indices
    return LiveRecord(layer, logits, SOFTMAX.weigh(probs, index), index, SOFTMAX)


def test_promote_matches_paper_appendix_b():
    # r = [E1..E6], C = {E3, E4, E6}, M = 4, K = 2, J = 1 -> [E1, E3, E4, E2, E5, E6] -> selects E1, E3
    ranking = torch.tensor([[0, 1, 2, 3, 4, 5]])
    cached = torch.tensor([False, False, True, True, False, True])
    out = promote_select(ranking, cached, torch.tensor([4]), 1, 2)
    assert out.tolist() == [[0, 2]]
    assert promote_select(ranking, cached, torch.tensor([4]), 1, 4).tolist() == [[0, 2, 3, 1]]
    # M = 2: only E1, E2 may be promoted, neither is cached -> the router's own choice
    assert promote_select(ranking, cached, torch.tensor([2]), 1, 2).tolist() == [[0, 1]]


def test_max_rank_policy():
    pol = ROUTING.build({"name": "max_rank", "M": 4, "J": 1})
    rec = record([[0.30, 0.25, 0.2, 0.15, 0.06, 0.04]], 2)
    assert pol.apply(rec, FakeCache([2, 3, 5])).tolist() == [[0, 2]]


def test_cumsum_threshold_sets_m():
    # probabilities .4 .3 .2 .1: p = 0.6 needs 2 experts (0.4 < 0.6, 0.7 >= 0.6) -> M = 2, only E0/E1 eligible
    rec = record([[0.4, 0.3, 0.2, 0.1]], 2)
    cache = FakeCache([2, 3])
    assert ROUTING.build({"name": "cumsum", "p": 0.6, "J": 1}).apply(rec, cache).tolist() == [[0, 1]]
    # p = 0.8 -> M = 3: E2 (cached) is promoted over E1
    assert ROUTING.build({"name": "cumsum", "p": 0.8, "J": 1}).apply(rec, cache).tolist() == [[0, 2]]
    # p = 0 -> M = 0: nothing promoted
    assert ROUTING.build({"name": "cumsum", "p": 0.0, "J": 0}).apply(rec, cache).tolist() == [[0, 1]]


def test_cache_prior_equation_9():
    # z = [3, 2, 1, 0] (as log-probabilities up to a constant), k = 2, cached {3}, J = 1:
    # Delta_avg = 3; lambda = 0.5 -> z' = [4.5, 2, 1, 1.5] -> {0, 1}; lambda = 1 -> [6, 2, 1, 3] -> {0, 3}
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    rec = LiveRecord(0, logits, None, torch.tensor([[0, 1]]), SOFTMAX)

    class View:
        num_layers = 1

    for lam, expect in ((0.5, [0, 1]), (1.0, [0, 3])):
        pol = ROUTING.build({"name": "cache_prior", "lambda": lam, "J": 1})
        pol.setup(View())
        assert sorted(pol.apply(rec, FakeCache([3])).tolist()[0]) == expect
    pol = ROUTING.build({"name": "cache_prior", "lambda": 0.0, "J": 1})
    pol.setup(View())
    assert pol.apply(rec, FakeCache([3])) is None


def test_prune_keeps_top_h_with_family_weights():
    probs = [[0.4, 0.3, 0.2, 0.1]]
    pol = ROUTING.build({"name": "prune", "h": 1})
    rec = record(probs, 2)
    routed = pol.route(rec, FakeCache())  # one value: the selection, its weights, the emptied slots
    assert routed.index.tolist() == [[0, 0]] and routed.void.tolist() == [[False, True]]  # the pruned slot points
    assert routed.weights.tolist()[0] == pytest.approx([0.4, 0.0])  # at the top-1, weight 0 (OLMoE: no renorm)
    assert torch.equal(pol.apply(rec, FakeCache()), routed.index)  # (apply: route's index)
    rec.scoring = Scoring(False, True, 1.0)  # Mixtral-style renormalisation over the kept set
    assert pol.route(rec, FakeCache()).weights.tolist()[0] == pytest.approx([1.0, 0.0])


def test_replace_rank_swaps_only_that_rank_for_an_unselected_expert():
    probs = [[0.4, 0.3, 0.2, 0.1]] * 50
    rec = record(probs, 2)  # every token selects E0, E1
    for rank in (0, 1):
        index = ROUTING.build({"name": "replace_rank", "rank": rank, "seed": 3}).apply(rec, FakeCache())
        kept = 1 - rank
        assert index[:, kept].tolist() == [kept] * 50  # the other rank is untouched
        drawn = index[:, rank].tolist()
        assert set(drawn) == {2, 3}  # only experts the token did not select, both drawn over 50 tokens
        again = ROUTING.build({"name": "replace_rank", "rank": rank, "seed": 3}).apply(rec, FakeCache())
        assert again.tolist() == index.tolist()  # seeded: a live run and its replay swap the same experts
    assert ROUTING.build({"name": "replace_rank", "rank": 2}).apply(rec, FakeCache()) is None  # k = 2
    # a router that returns its top-k unsorted (DeepSeek: topk(sorted=False)): rank 0 is still the top-1
    unsorted = record([[0.4, 0.3, 0.2, 0.1]] * 50, 2, index=torch.tensor([[1, 0]] * 50))
    index = ROUTING.build({"name": "replace_rank", "rank": 0, "seed": 3}).apply(unsorted, FakeCache())
    assert 0 not in index.reshape(-1).tolist() and index[:, 1].tolist() == [1] * 50
    pruned = ROUTING.build({"name": "prune", "h": 1}).apply(unsorted, FakeCache())
    assert pruned.tolist() == [[0, 0]] * 50  # keeps E0 (the top-1), not column 0's E1
    with pytest.raises(ConfigError, match="rank=-1"):
        ROUTING.params({"name": "replace_rank", "rank": -1})


def test_drop_keeps_top_j_misses():
    # one token, selection by probability: E0 (rank 0), E1 (rank 1), E2 (rank 2); J = 2
    rec = record([[0.4, 0.3, 0.2, 0.1]], 3)
    acts = MISS.build({"name": "drop", "J": 2}).handle(0, [0, 1, 2], rec, FakeCache())
    assert [a.kind for a in acts] == ["fetch", "fetch", "drop"]
    acts = MISS.build({"name": "drop", "J": 0}).handle(0, [0], rec, FakeCache())
    assert acts[0].kind == "drop"


class Store:
    precisions = ["native", "int8", "int4", "int2"]

    def check(self, names, where):
        for n in names:
            assert n in self.precisions


class View:
    store = Store()


def test_fetch_priority_bands():
    # 5 requested experts with scores .30 .25 .2 .15 .1; their 60th percentile (linear) is .22, so the
    # bottom 60% (E2, E3, E4) are degraded, split by rank over int4, int2: E2, E3 -> int4, E4 -> int2
    rec = record([[0.30, 0.25, 0.2, 0.15, 0.1]], 5)
    pol = MISS.build({"name": "fetch_priority", "precisions": "int8:4:2", "percentile": 60.0})
    pol.setup(View())
    acts = pol.handle(0, [0, 1, 2, 3, 4], rec, FakeCache())
    assert [a.precision for a in acts] == ["int8", "int8", "int4", "int4", "int2"]
    assert pol.fetch_precision == "int8"


def test_drop_priority_cascade():
    # same scores, J = 1, percentile 60: E0 rank 0 -> int8; E1 above the percentile -> int8;
    # below: E2, E3, E4 over 3 bands (int4, int2, drop)
    rec = record([[0.30, 0.25, 0.2, 0.15, 0.1]], 5)
    pol = MISS.build({"name": "drop_priority_cascade", "precisions": "int8:4:2", "percentile": 60.0, "J": 1})
    pol.setup(View())
    acts = pol.handle(0, [0, 1, 2, 3, 4], rec, FakeCache())
    assert [(a.kind, a.precision) for a in acts] == [("fetch", "int8")] * 2 + [("fetch", "int4"), ("fetch", "int2"),
                                                                                ("drop", None)]
    pol = MISS.build({"name": "drop_priority_cascade", "precisions": "int8:4", "percentile": 60.0, "J": 1})
    pol.setup(View())
    acts = pol.handle(0, [3, 4], rec, FakeCache())
    assert [(a.kind, a.precision) for a in acts] == [("fetch", "int4"), ("drop", None)]


def test_substitute_zhu_expert_cache_router():
    # k = 2 of 5; scores .40 .22 .20 .10 .08 -> selection {0, 1}; S_{k+1} = .20 (E2).
    # alpha = 0.2: E1 (.22) is low-score (.20 <= .22 < .24); eligible substitutes: inactive, resident,
    # .16 < s <= .20 -> E2 if resident. E0 (.40) is top-score: always fetched.
    rec = record([[0.40, 0.22, 0.20, 0.10, 0.08]], 2)
    pol = MISS.build({"name": "substitute", "alpha": 0.2})
    acts = pol.handle(0, [0, 1], rec, FakeCache(resident=[2, 3]))
    assert acts[0].kind == "fetch"
    assert acts[1].kind == "substitute" and acts[1].substitute.tolist() == [2]
    # E2 not resident (only E3 at .10, outside the band) -> fetch
    acts = pol.handle(0, [1], rec, FakeCache(resident=[3]))
    assert acts[0].kind == "fetch"


def test_cpu_compute_two_pointer():
    # 4 misses, C_load = 1, C_cpu = 0.4 per token (1 token each): the sweep loads from the high-score end and
    # computes from the low-score end while T_load > T_cpu: load E(.4) [1 vs 0], cpu E(.1) [1, .4],
    # cpu E(.2) [1, .8], cpu E(.3) [1, 1.2] -> 1 loaded, 3 on the host: max(T_load, T_cpu) = 1.2
    rec = record([[0.4, 0.3, 0.2, 0.1]], 4)
    pol = MISS.build({"name": "cpu_compute"})
    acts = pol.handle(0, [0, 1, 2, 3], rec, FakeCache(host=0.4, transfer=1.0))
    assert [a.kind for a in acts] == ["fetch", "host", "host", "host"]
    # C_cpu = 5: load E(.4) [1 vs 0], cpu E(.1) [1 vs 5], load E(.3) [2], load E(.2) [3] -> max = 5, although
    # loading all four would take 4: Zhu's greedy does not minimise max(T_load, T_cpu) in every case
    acts = pol.handle(0, [0, 1, 2, 3], rec, FakeCache(host=5.0, transfer=1.0))
    assert [a.kind for a in acts] == ["fetch", "fetch", "fetch", "host"]


class HybridView(FakeCache):
    """What miss=hybrid reads: per-expert link, host and device costs and what each resource has queued."""

    def __init__(self, host=1.0, transfer=1.0, low=None, device=0.0, link_backlog=0.0, host_backlog=0.0, beside=True):
        super().__init__(host=host, transfer=transfer)
        c = self.clock
        c.host_beside_device = lambda: beside
        c.transfer_time = lambda precision=None: low if precision not in (None, "native") else transfer
        c.device_time = lambda slots, experts: device * slots
        c.link_backlog = lambda: link_backlog
        c.host_backlog = lambda: host_backlog


class _Hybrid:
    """miss=hybrid with its answer spelt out: None (every miss fetched native, the manager's fast path) becomes
    one native fetch per miss."""

    def __init__(self, pol):
        self.pol = pol

    def handle(self, layer, missing, rec, view):
        from specmd.engine.outcomes import Fetched

        out = self.pol.handle(layer, missing, rec, view)
        return [Fetched("native")] * len(missing) if out is None else out


def hybrid(**params):
    from types import SimpleNamespace

    pol = MISS.build({"name": "hybrid", **params})
    pol.setup(SimpleNamespace(num_experts=4, store=SimpleNamespace(check=lambda precisions, who: None)))
    return _Hybrid(pol)


def test_hybrid_places_each_miss_where_the_layer_ends_first():
    # 4 misses of one token each, C_load = 1, host 0.4 per token, free device: e0 host (.4 < 1), e1 host (.8 < 1),
    # e2 fetch (max(1, .8) = 1 < 1.2), e3 host (max(1, 1.2) = 1.2 < max(2, .8)): the layer ends at 1.2
    rec = record([[0.4, 0.3, 0.2, 0.1]], 4)
    acts = hybrid().handle(0, [0, 1, 2, 3], rec, HybridView(host=0.4, transfer=1.0))
    assert [a.kind for a in acts] == ["host", "host", "fetch", "host"]
    assert acts[2].precision == "native"
    # C_cpu = 5 (Zhu's sweep sends one miss to the host, ending at 5): hybrid fetches all four, ending at 4
    acts = hybrid().handle(0, [0, 1, 2, 3], rec, HybridView(host=5.0, transfer=1.0))
    assert [a.kind for a in acts] == ["fetch"] * 4
    assert hybrid().pol.handle(0, [0, 1, 2, 3], rec, HybridView(host=5.0, transfer=1.0)) is None  # (the fast path)
    # ties go to the fetch (it may hit later): C_cpu = C_load = 1, one miss
    assert [a.kind for a in hybrid().handle(0, [2], rec, HybridView(host=1.0, transfer=1.0))] == ["fetch"]


def test_hybrid_sees_the_links_backlog_and_the_devices_share():
    rec = record([[0.4, 0.3, 0.2, 0.1]], 1)
    # one miss, C_load = 1, host 2: fetched on an idle link; behind a 3 s transfer it is computed on the host
    assert hybrid().handle(0, [0], rec, HybridView(host=2.0, transfer=1.0))[0].kind == "fetch"
    assert hybrid().handle(0, [0], rec, HybridView(host=2.0, transfer=1.0, link_backlog=3.0))[0].kind == "host"
    # the device's compute after the fetch counts: 1 + 1.5 > 2
    assert hybrid().handle(0, [0], rec, HybridView(host=2.0, transfer=1.0, device=1.5))[0].kind == "host"
    # a hit (expert 1, 1.5 s on the device) beside the miss, host 3: beside the device the host ends at 3, a fetch
    # at 1 + 1.5 + 1.5 = 4 -> host; on the device's cores (a CPU) the device's compute comes after both: host
    # max(0, 3) + 1.5 = 4.5, fetch max(1, 0) + 3 = 4 -> fetched
    rec2 = record([[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]], 1)
    assert hybrid().handle(0, [0], rec2, HybridView(host=3.0, transfer=1.0, device=1.5))[0].kind == "host"
    assert hybrid().handle(0, [0], rec2, HybridView(host=3.0, transfer=1.0, device=1.5, beside=False))[0].kind == "fetch"
    # so does the host's queue: behind a 2 s transfer a fetch ends at 2.5; the host at 2 when idle, 3 behind 1 s
    assert hybrid().handle(0, [0], rec, HybridView(host=2.0, transfer=0.5, link_backlog=2.0))[0].kind == "host"
    assert hybrid().handle(0, [0], rec, HybridView(host=2.0, transfer=0.5, link_backlog=2.0,
                                                    host_backlog=1.0))[0].kind == "fetch"


def test_hybrid_orders_misses_by_tokens_and_offers_low_copies_to_low_scores():
    # tokens: expert 3 three times, expert 0 once; host .3 per token, C_load 1. Most tokens first: e3 to the host
    # (.9 < 1), then e0 fetched (max(1, .9) = 1 < 1.2). By id, e0 would go to the host (.3) and e3 be fetched
    probs = [[0.1, 0.1, 0.1, 0.7]] * 3 + [[0.7, 0.1, 0.1, 0.1]]
    rec = record(probs, 1)
    acts = hybrid().handle(0, [0, 3], rec, HybridView(host=0.3, transfer=1.0))
    assert [a.kind for a in acts] == ["fetch", "host"]
    # a low copy (0.2 s) for misses below the 60th percentile of the call's scores: requested {0: .7, 2: .4,
    # 3: .7} (token 3 of a second record selects 2 at .4); expert 2 is degraded, 0 and 3 are not
    probs2 = [[0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1], [0.2, 0.2, 0.4, 0.2]]
    rec2 = record(probs2, 1)
    acts = hybrid(low="int4").handle(0, [0, 2, 3], rec2, HybridView(host=10.0, transfer=1.0, low=0.2))
    assert [(a.kind, a.precision) for a in acts] == [("fetch", "native"), ("fetch", "int4"), ("fetch", "native")]
    cls, p = MISS.params({"name": "hybrid"})
    assert cls.lossless(p) and cls.required_precisions(p) == ["native"]
    cls, p = MISS.params({"name": "hybrid", "low": "int4"})
    assert not cls.lossless(p) and cls.required_precisions(p) == ["native", "int4"]
    with pytest.raises(Exception, match="low='int5'"):
        MISS.params({"name": "hybrid", "low": "int5"})


class PrefetchView:
    num_layers = 4
    num_experts = 4
    top_k = 1

    def __init__(self, probs):
        self.probs = torch.tensor(probs)

    def next_layer(self, layer):
        return layer + 1 if layer + 1 < self.num_layers else None

    def signal(self, layer):  # raw: (logits, index); the record's scoring (softmax) turns log p back into p
        p = self.probs * (layer + 1)  # distinct per target layer
        p = p / p.sum(-1, keepdim=True)
        return p.log(), p.topk(self.top_k, dim=-1).indices


def test_score_prefetch_percentile():
    view = PrefetchView([[0.5, 0.3, 0.15, 0.05]])
    pol = PREFETCH.build({"name": "score", "percentile": 50.0, "window": 1})
    pol.setup(view)
    rec = LiveRecord(0, torch.zeros(1, 4), None, torch.tensor([[0]]), SOFTMAX, view.signal)
    # median of [.5 .3 .15 .05] = .225 -> {0, 1}, issued by descending score
    assert pol.predict(rec, view) == [(1, [0, 1])]


def test_lookahead_targets_several_layers():
    view = PrefetchView([[0.1, 0.6, 0.2, 0.1]])
    pol = PREFETCH.build({"name": "lookahead", "depth": 2})
    pol.setup(view)
    rec = LiveRecord(1, torch.zeros(1, 4), None, torch.tensor([[1]]), SOFTMAX, view.signal)
    assert pol.predict(rec, view) == [(2, [1]), (3, [1])]
    rec.layer = 3
    assert pol.predict(rec, view) == []


def test_hqq_store_bytes_lossy_and_disk_cache(tmp_path, monkeypatch):
    from tests.conftest import tiny

    from specmd.quant import QUANT

    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path))
    model = tiny("olmoe")
    experts = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]
    E = model.config.num_experts
    # optimize=false keeps this fast on random weights (HQQ's refinement needs all its iterations there)
    q = QUANT.build({"name": "hqq", "precisions": ["bf16", "int8", "int4", "int2"], "optimize": False})
    store = q.build(experts, E, "tiny-olmoe")
    b = store.bytes_of
    assert b["native"] > b["bf16"] > b["int8"] > b["int4"] > b["int2"] > 0
    assert store.full == "native" and store.lowest == "int2"
    files = sorted(p.name for p in (tmp_path / "quant").iterdir())
    assert len(files) == 3  # int8, int4, int2 (bf16 is a cast)
    errs = []
    w = experts[0].gate_up_proj.detach()[3]
    for prec in ("int8", "int4", "int2"):
        dq = store.weights(0, 3, prec)["gate_up_proj"]
        errs.append(float((dq - w).norm() / w.norm()))
    assert 0 < errs[0] < errs[1] < errs[2] < 1
    # a stored copy's raw tensors are exactly the bytes the engine counts (what execution=offload moves), and
    # they unpack to the weights a simulated run uses
    for prec in ("bf16", "int8", "int4", "int2"):
        r = store.raw(2, 6, prec)
        assert sum(t.numel() * t.element_size() for t in r.values()) == b[prec], prec
        assert all(t.dtype == torch.float16 for n, t in r.items() if n.endswith((".scale", ".zero"))), prec
        got, want = store.unpack(2, prec, r, torch.device("cpu")), store.weights(2, 6, prec)
        assert all(torch.equal(got[n], want[n]) for n in want), prec
    # a second build reads the disk cache and quantizes nothing
    import hqq.core.quantize as hq

    monkeypatch.setattr(hq.Quantizer, "quantize", lambda *a, **k: pytest.fail("re-quantized"))
    again = q.build(experts, E, "tiny-olmoe")
    assert again.bytes_of == store.bytes_of
    assert torch.equal(again.weights(1, 5, "int4")["down_proj"], store.weights(1, 5, "int4")["down_proj"])


def test_lossy_stack_runs_real_quantized_weights(tmp_path, monkeypatch):
    from tests.conftest import sample_ids, tiny

    from specmd.hardware import HardwareConfig
    from specmd.hook import install

    monkeypatch.setenv("SPECMD_CACHE", str(tmp_path))
    model = tiny("olmoe")
    ids = sample_ids()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref = model(ids).logits
        outs = {}
        for prec in ("int8", "int2"):
            st = install(model, spec_of(miss={"name": "fetch", "precision": prec}, prefetch="none",
                                             hardware=HardwareConfig(capacity=1.0),
                                             quant={"name": "hqq", "optimize": False}))
            with st:
                outs[prec] = model(ids).logits
            s = st.cache.stats.summary()
            assert s["miss_outcomes"] == {f"fetched_{prec}": s["misses"], "dropped": 0, "substituted": 0,
                                          "host_computed": 0}
            assert s["bytes_by_precision"][prec] == s["misses"] * st.store.bytes_of[prec]
    e8 = float((outs["int8"] - ref).abs().max())
    e2 = float((outs["int2"] - ref).abs().max())
    assert 0 < e8 < e2
    for n, p in model.named_parameters():  # native weights restored exactly
        assert torch.equal(p, before[n]), n


def test_prune_fidelity_and_requests_end_to_end():
    from tests.conftest import sample_ids, tiny

    from specmd.hardware import HardwareConfig
    from specmd.hook import install

    model = tiny("mixtral")  # top-2: h = 1 keeps one of two slots per token
    ids = sample_ids()
    stack = install(model, spec_of(routing={"name": "prune", "h": 1}, prefetch="none",
                                        hardware=HardwareConfig(capacity=1.0)))
    with torch.no_grad(), stack:
        model(ids)
    st = stack.cache.stats
    assert st.fidelity() == pytest.approx(0.5)
    s = st.summary()
    assert s["requests"] < s["requests_router"]
    assert s["miss_rate_vs_router"] == pytest.approx(s["misses"] / s["requests_router"])


def test_fetch_lowest_bit_uses_the_lowest_precision_of_its_cascade():
    pol = MISS.build({"name": "fetch_lowest_bit", "precisions": "int8:4:2"})

    class V:
        store = type("S", (), {"bits_of": {"native": 32, "int8": 8, "int4": 4, "int2": 2},
                               "check": lambda self, names, where: None})()

    pol.setup(V())
    assert pol.fetch_precision == "int2" and pol.handle(0, [1], None, None) is None
    assert type(pol).required_precisions(pol.params) == ["int8", "int4", "int2"]


@pytest.mark.parametrize("seed", range(30))
def test_promote_invariants(seed):
    """Random rankings and caches: k distinct experts, the top-J always kept, and every other selected
    expert is either a cached one within the top M or needed to fill up to k."""
    g = torch.Generator().manual_seed(seed)
    E = 12
    T = 5
    k = int(torch.randint(1, 6, (1,), generator=g))
    J = int(torch.randint(0, k + 1, (1,), generator=g))
    ranking = torch.stack([torch.randperm(E, generator=g) for _ in range(T)])
    cached = torch.rand(E, generator=g) < 0.4
    M = torch.randint(0, E + 1, (T,), generator=g)
    out = promote_select(ranking, cached, M, J, k)
    for t in range(T):
        sel = out[t].tolist()
        assert len(set(sel)) == k
        assert sel[:J] == ranking[t, :J].tolist()
        promotable = [e for e in ranking[t, J:M[t]].tolist() if cached[e]] if M[t] > J else []
        assert sel[J:J + len(promotable)] == promotable[: k - J]


@pytest.mark.parametrize("name", ROUTING.names())
def test_every_routing_policy_answers_one_routed_value_and_keeps_no_state(name):
    """The policy <-> engine conversation is one typed value (issue 55): ``route`` returns a Routed -- the
    selection [T, k], its weights [T, k], the emptied slots or None -- or None, the same for the same record,
    with nothing kept on the policy between calls; ``apply`` is its index."""
    from types import SimpleNamespace

    from specmd.engine.record import Routed

    params = getattr(ROUTING.get(name), "Params", None)
    pol = ROUTING.build({"name": name, **({"passes": "all"} if params and "passes" in vars(params()) else {})})
    pol.setup(SimpleNamespace(num_layers=1, num_experts=6, top_k=2))
    probs = [[0.30, 0.25, 0.20, 0.12, 0.08, 0.05], [0.05, 0.08, 0.12, 0.20, 0.25, 0.30],
             [0.40, 0.05, 0.25, 0.10, 0.12, 0.08]]
    cache = FakeCache(present=[2, 5], resident=[2, 5])
    state = {k: id(v) for k, v in vars(pol).items()}
    first, second = pol.route(record(probs, 2), cache), pol.route(record(probs, 2), cache)
    assert {k: id(v) for k, v in vars(pol).items()} == state  # no attribute made or rebound by a call
    if first is None:
        assert second is None and pol.apply(record(probs, 2), cache) is None
        return
    assert isinstance(first, Routed) and first.index.shape == (3, 2) and first.index.dtype == torch.long
    assert first.weights.shape == (3, 2) and first.weights.is_floating_point()
    assert first.void is None or (first.void.shape == (3, 2) and first.void.dtype == torch.bool)
    if name == "replace_rank":  # (it draws from its own generator: the same record gets another draw)
        return
    same = (first.void is None) == (second.void is None) and (first.void is None or torch.equal(first.void, second.void))
    assert torch.equal(first.index, second.index) and torch.equal(first.weights, second.weights) and same
    assert torch.equal(pol.apply(record(probs, 2), cache), first.index)
