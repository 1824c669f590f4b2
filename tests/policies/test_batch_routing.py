"""Batch-aware routing: ``routing=piggyback`` (Opportunistic Expert Activation, arXiv 2511.02237) and
``routing=budget`` (a cap on distinct experts per layer call). Hand-worked calls with exact selections,
weights and empty slots; the invariants on random calls against a literal per-token reference; the engine's
accounting of a rerouted call; bad parameters refused by name (directly, through Hydra, and against the
model's geometry); one generation on the embedded model."""

import itertools
import re

import pytest
import torch
from hydra import compose, initialize_config_dir

from specmd import CONF_DIR
from specmd.app import Run
from specmd.compose import spec_of
from specmd.engine import Geometry
from specmd.engine.engine import Engine
from specmd.engine.record import LiveRecord, Scoring
from specmd.errors import ConfigError
from specmd.hardware import HardwareConfig
from specmd.policies.base import ranked_by_score
from specmd.policies.routing import ROUTING

OLMOE = Scoring(False, False, 1.0)  # raw probabilities (no renormalisation over the top-k)
MIXTRAL = Scoring(False, True, 1.0)  # renormalised over the selection (Qwen3, Mixtral)


def record(probs, k, scoring=OLMOE, index=None):
    probs = torch.as_tensor(probs, dtype=torch.float32)
    if index is None:
        index = probs.topk(k, dim=-1).indices
    return LiveRecord(0, probs.log(), scoring.weigh(probs, index), index, scoring)


def routed(policy, rec):
    """What Engine.route leaves on the record: (index, weights, void) of the policy's Routed, or None when
    unchanged."""
    out = policy.route(rec, None)
    if out is None:
        return None
    return out.index.tolist(), out.weights, out.void


def close(t, want) -> bool:
    return torch.allclose(t.float(), torch.tensor(want, dtype=torch.float32), atol=1e-6)


def compose_run(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return Run(compose(config_name="config", overrides=overrides))


# ---- piggyback: hand-worked ----------------------------------------------------------------------------

# 4 tokens, 8 experts, top-4; with k0 = 2 the baselines are {0,1}, {1,2}, {2,0}, {3,4}: S^base = {0..4}
PIGGY = [
    [.30, .25, .05, .12, .03, .15, .08, .02],  # top-4 {0,1,5,3}: keeps 0,1; from S^base: 3 (.12), 2 (.05)
    [.08, .30, .25, .04, .06, .02, .15, .10],  # top-4 {1,2,6,7}: keeps 1,2; from S^base: 0 (.08), 4 (.06)
    [.25, .10, .30, .06, .20, .05, .03, .01],  # top-4 {2,0,4,1}: keeps 2,0; then 4 (.20), 1 (.10): its own
    [.03, .01, .05, .30, .25, .10, .06, .20],  # top-4 {3,4,7,5}: keeps 3,4; from S^base: 2 (.05), 0 (.03)
]


def test_piggyback_fills_each_token_from_the_union_of_the_baselines():
    pol = ROUTING.build({"name": "piggyback", "k0": 2})
    rec = record(PIGGY, 4)
    index, w, void = routed(pol, rec)
    assert index == [[0, 1, 3, 2], [1, 2, 0, 4], [2, 0, 4, 1], [3, 4, 2, 0]]
    assert not void.any()  # S^base holds 5 >= k experts: every token gets k
    assert close(w, [[.30, .25, .12, .05], [.30, .25, .08, .06], [.30, .25, .20, .10],
                                        [.30, .25, .05, .03]])  # OLMoE: the raw probabilities
    rec.scoring = MIXTRAL  # renormalised over the token's set (OEA's Eq. 1)
    assert pol.route(rec, None).weights[0].tolist() == pytest.approx([.30 / .72, .25 / .72, .12 / .72,
                                                                               .05 / .72])


def test_piggyback_leaves_a_slot_empty_when_the_union_is_smaller_than_k():
    # tokens 0 and 1 alone: S^base = {0, 1} | {1, 2} = {0, 1, 2}, 3 < k = 4 experts
    pol = ROUTING.build({"name": "piggyback", "k0": 2})
    rec = record(PIGGY[:2], 4)
    index, w, void = routed(pol, rec)
    assert index == [[0, 1, 2, 0], [1, 2, 0, 1]]  # the empty slot points at the token's top-1...
    assert void.tolist() == [[False, False, False, True]] * 2
    assert close(w, [[.30, .25, .05, 0], [.30, .25, .08, 0]])  # ...with weight 0
    rec.scoring = MIXTRAL
    assert pol.route(rec, None).weights[1].tolist() == pytest.approx([.30 / .63, .25 / .63, .08 / .63, 0])


@pytest.mark.parametrize("scoring", [OLMOE, MIXTRAL])
def test_piggyback_on_one_token_is_prune_at_h_equals_k0(scoring):
    """A call of one token: S^base is its own top k0, nothing piggybacks ("a batch size of 1 deems the
    piggy-backing redundant"): exactly ``prune`` with h = k0 (selection, weights, empty slots)."""
    for row, k0 in itertools.product(PIGGY, (1, 2, 3)):
        rec = record([row], 4, scoring)
        got = routed(ROUTING.build({"name": "piggyback", "k0": k0}), rec)
        want = routed(ROUTING.build({"name": "prune", "h": k0}), rec)
        assert got[0] == want[0]
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert got[2].sum() == 4 - k0


def test_piggyback_unchanged_calls_are_none():
    rec = record(PIGGY, 4)
    assert ROUTING.build({"name": "piggyback", "k0": 4}).apply(rec, None) is None  # k0 = k: the router's own
    # every token's own top-4 lies in S^base = {0, 1} | {2, 3}: each gets its own selection back
    both = record([[.30, .25, .15, .10, .08, .06, .04, .02], [.15, .10, .30, .25, .08, .06, .04, .02]], 4)
    assert ROUTING.build({"name": "piggyback", "k0": 2}).apply(both, None) is None


def one_call(routing: dict, rec, kind: str = "decode") -> tuple:
    """(whether the routing changed the selection, the engine's results) of ``rec`` served as one layer call
    of a ``kind`` pass: one MoE layer of 8 experts, a cache that holds them all, no prefetch."""
    g = Geometry(num_layers=1, num_experts=8, top_k=rec.top_k, expert_bytes=10, total_bytes=80)
    eng = Engine(g, spec_of(routing=routing, prefetch="none", hardware=HardwareConfig(capacity=1.0)))
    eng.begin_pass(kind, rec.tokens, 10)
    changed = eng.route(rec)
    eng.layer(rec)
    eng.end_pass()
    return changed, eng.results()


def test_piggyback_through_the_engine_counts_fidelity_and_requests():
    changed, out = one_call({"name": "piggyback", "k0": 2}, record(PIGGY, 4))
    assert changed
    assert out["routing"]["fidelity"] == pytest.approx(11 / 16)  # kept router selections: 3 + 2 + 4 + 2
    assert out["cache"]["requests"] == 5 and out["cache"]["requests_router"] == 8  # |S^base| vs the router's


# ---- piggyback: invariants --------------------------------------------------------------------------------

def random_call(seed, scoring=OLMOE):
    g = torch.Generator().manual_seed(seed)
    E = [8, 16, 64][seed % 3]
    k = [2, 4, 8][seed // 3 % 3]
    T = int(torch.randint(1, 13, (1,), generator=g))
    logits = torch.randn(T, E, generator=g) * 2
    probs = logits.softmax(-1)
    index = probs.topk(k, dim=-1).indices
    if seed % 2:  # a router that returns its top-k unsorted (DeepSeek): ranks come from the probabilities
        index = index[:, torch.randperm(k, generator=g)]
    return LiveRecord(0, logits, scoring.weigh(probs, index), index, scoring), g


def oea_reference(probs, original, k0, k):
    """Algorithm 1 of the paper, token by token (with the text's bound: at most k experts)."""
    ranks = [sorted(range(probs.shape[1]), key=lambda e: (-float(probs[t, e]), e)) for t in range(len(probs))]
    mine = ranked_by_score(probs, original).tolist()
    base = [row[:k0] for row in mine]
    union = set().union(*base)
    out = []
    for t, row in enumerate(ranks):
        s = list(base[t])
        for e in row:
            if len(s) >= k:
                break
            if e in union and e not in s:
                s.append(e)
        out.append(s)
    return out, union


@pytest.mark.parametrize("seed", range(36))
def test_piggyback_invariants(seed):
    rec, g = random_call(seed, [OLMOE, MIXTRAL][seed % 2])
    k = rec.top_k
    for k0 in range(1, k):
        pol = ROUTING.build({"name": "piggyback", "k0": k0})
        got = routed(pol, rec)
        want, union = oea_reference(rec.probs, rec.original, k0, k)
        if got is None:  # unchanged: every token's own top-k lies in S^base
            assert all(sorted(w) == sorted(o) for w, o in zip(want, rec.original.tolist()))
            continue
        index, w, void = got
        top_k0 = ranked_by_score(rec.probs, rec.original)[:, :k0].tolist()
        for t, row in enumerate(index):
            kept = [e for e, v in zip(row, void[t].tolist()) if not v]
            assert row[:k0] == top_k0[t]  # every token keeps its top k0, first
            assert kept == want[t]  # the literal algorithm's set, in its order
            assert len(kept) == len(set(kept)) == min(k, len(union))
            assert set(row) <= union  # nothing outside the union of the baselines, empty slots included
        assert set(itertools.chain(*index)) == union  # distinct experts per call = |S^base|, never more
        assert (w[void] == 0).all()
        if rec.scoring.renorm:
            assert w.sum(-1).tolist() == pytest.approx([1.0] * len(index))
        else:
            assert w[~void].tolist() == pytest.approx(rec.probs.gather(1, torch.tensor(index))[~void].tolist())


# ---- budget: hand-worked -----------------------------------------------------------------------------------

# 4 tokens, 8 experts, top-2; the router's union {0, 1, 2, 3, 4} (5 experts)
BUDGET = [
    [.40, .30, .10, .08, .05, .04, .02, .01],  # {0, 1}
    [.35, .12, .08, .06, .30, .05, .03, .01],  # {0, 4}
    [.08, .15, .06, .60, .05, .03, .02, .01],  # {3, 1}
    [.10, .15, .40, .07, .20, .04, .03, .01],  # {2, 4}
]
# selection mass: E0 .75, E3 .60, E4 .50, E1 .45, E2 .40 -> a budget of 3 by mass is {0, 3, 4};
# selections: E0, E1, E4 twice, E2, E3 once -> by count it is {0, 1, 4}


def test_budget_by_mass_substitutes_the_best_unselected_in_budget_expert():
    pol = ROUTING.build({"name": "budget", "max_experts": 3, "max_fraction": None})
    rec = record(BUDGET, 2)
    index, w, void = routed(pol, rec)
    # token 0 loses E1 -> E3 (.08 > E4 .05); token 2 loses E1 -> E0 (.08); token 3 loses E2 -> E0 (.10 > E3 .07)
    assert index == [[0, 3], [0, 4], [3, 0], [4, 0]]
    assert not void.any()
    assert close(w, [[.40, .08], [.35, .30], [.60, .08], [.20, .10]])
    rec.scoring = MIXTRAL
    assert pol.route(rec, None).weights[0].tolist() == pytest.approx([.40 / .48, .08 / .48])


def test_budget_by_count_keeps_the_most_selected_experts():
    pol = ROUTING.build({"name": "budget", "max_experts": 3, "max_fraction": None, "by": "count"})
    index, w, void = routed(pol, record(BUDGET, 2))
    # token 2 loses E3 -> E0 (.08 > E4 .05); token 3 loses E2 -> E1 (.15 > E0 .10)
    assert index == [[0, 1], [0, 4], [1, 0], [4, 1]]
    assert not void.any()
    assert close(w, [[.40, .30], [.35, .30], [.15, .08], [.20, .15]])


def test_budget_drop_empties_the_slots_outside_it():
    pol = ROUTING.build({"name": "budget", "max_experts": 3, "max_fraction": None, "overflow": "drop"})
    rec = record(BUDGET, 2)
    index, w, void = routed(pol, rec)
    assert index == [[0, 0], [0, 4], [3, 3], [4, 4]]  # an empty slot points at the token's kept expert
    assert void.tolist() == [[False, True], [False, False], [False, True], [False, True]]
    assert close(w, [[.40, 0], [.35, .30], [.60, 0], [.20, 0]])
    rec.scoring = MIXTRAL
    assert close(pol.route(rec, None).weights, [[1, 0], [.35 / .65, .30 / .65], [1, 0],
                                                                           [1, 0]])


def test_budget_below_top_k_and_tokens_left_without_an_expert():
    rec = record(BUDGET, 2)
    one = {"name": "budget", "max_experts": 1, "max_fraction": None}
    index, w, void = routed(ROUTING.build(one), rec)  # the budget is E0: every token runs E0 alone
    assert index == [[0, 0]] * 4 and void.tolist() == [[False, True]] * 4
    assert w[:, 0].tolist() == pytest.approx([.40, .35, .08, .10])
    # dropping instead: tokens 2 and 3 selected no budget expert and run nothing (their slots point at E0)
    index, w, void = routed(ROUTING.build({**one, "overflow": "drop"}), rec)
    assert index == [[0, 0]] * 4
    assert void.tolist() == [[False, True], [False, True], [True, True], [True, True]]
    assert close(w, [[.40, 0], [.35, 0], [0, 0], [0, 0]])


def test_budget_leaves_a_call_that_fits_unchanged():
    rec = record(BUDGET, 2)
    assert ROUTING.build({"name": "budget", "max_experts": 5, "max_fraction": None}).apply(rec, None) is None
    assert ROUTING.build({"name": "budget", "max_fraction": 0.625}).apply(rec, None) is None  # 5 of 8
    assert ROUTING.build({"name": "budget", "max_fraction": 0.5}).apply(rec, None) is not None  # 4 of 8
    # the default, a quarter of the layer, is never below a token's own top-k: one token always fits
    assert ROUTING.build({"name": "budget"}).apply(record(BUDGET[:1], 2), None) is None


def test_budget_through_the_engine_counts_fidelity_and_requests():
    for overflow, fidelity in (("substitute", 5 / 8), ("drop", 5 / 8)):
        changed, out = one_call({"name": "budget", "max_experts": 3, "max_fraction": None, "overflow": overflow},
                                record(BUDGET, 2))
        assert changed
        assert out["routing"]["fidelity"] == pytest.approx(fidelity)  # E0, E0 E4, E3, E4 kept of 8
        assert out["cache"]["requests"] == 3 and out["cache"]["requests_router"] == 5


# ---- budget: invariants -----------------------------------------------------------------------------------

def budget_reference(probs, original, b, by):
    """The budget in Python: the router's union ranked by (mass, count) or (count, mass), then expert id."""
    E = probs.shape[1]
    mass, count = [0.0] * E, [0] * E
    for t, row in enumerate(original.tolist()):
        for e in row:
            mass[e] += float(probs[t, e])
            count[e] += 1
    key = (lambda e: (-mass[e], -count[e], e)) if by == "mass" else (lambda e: (-count[e], -mass[e], e))
    return set(sorted((e for e in range(E) if count[e]), key=key)[:b])


@pytest.mark.parametrize("seed", range(36))
def test_budget_invariants(seed):
    rec, g = random_call(seed, [OLMOE, MIXTRAL][seed % 2])
    E, k = rec.probs.shape[1], rec.top_k
    original = rec.original.tolist()
    union = set(itertools.chain(*original))
    for b, by, overflow in itertools.product(sorted({1, k // 2 + 1, k, E // 2, E}), ("mass", "count"),
                                             ("substitute", "drop")):
        pol = ROUTING.build({"name": "budget", "max_experts": b, "max_fraction": None, "by": by, "overflow": overflow})
        got = routed(pol, rec)
        if len(union) <= b:
            assert got is None  # a call that fits is unchanged
            continue
        index, w, void = got
        budget = budget_reference(rec.probs, rec.original, b, by)
        assert set(itertools.chain(*index)) <= budget  # never more than the budget, empty slots included
        assert len(set(itertools.chain(*index))) <= b
        for t, row in enumerate(index):
            ran = [e for e, v in zip(row, void[t].tolist()) if not v]
            mine = [e for e in original[t] if e in budget]
            assert len(ran) == len(set(ran))
            assert sorted(ran[:len(mine)]) == sorted(mine)  # a token keeps every in-budget selection of its own
            others = sorted(budget - set(original[t]), key=lambda e: (-float(rec.probs[t, e]), e))
            subs = others[:k - len(mine)] if overflow == "substitute" else []
            assert ran[len(mine):] == subs  # then its best unselected in-budget experts, or nothing
        assert (w[void] == 0).all()
        if rec.scoring.renorm:
            ran_any = (~void).any(-1)
            assert w.sum(-1)[ran_any].tolist() == pytest.approx([1.0] * int(ran_any.sum()))


def test_budget_from_a_fraction_rounds_down():
    pol = ROUTING.build({"name": "budget", "max_fraction": 0.3})
    assert pol.limit(8) == 2 and pol.limit(64) == 19 and pol.limit(10) == 3  # 0.3 * 10 is 3 (not 2.9999...)
    assert ROUTING.build({"name": "budget", "max_fraction": 0.45}).limit(8) == 3  # at most: 3.6 is 3, not 4


# ---- bad parameters ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    (["routing=piggyback", "routing.k0=0"], "routing=piggyback: k0=0 must be >= 1"),
    (["routing=piggyback", "routing.k0=two"], "k0='two' must be an integer"),
    (["routing=budget", "routing.max_experts=4"], "max_experts=4 and max_fraction=0.25: set exactly one"),
    (["routing=budget", "routing.max_fraction=null"], "max_experts=None and max_fraction=None: set exactly one"),
    (["routing=budget", "routing.max_experts=0", "routing.max_fraction=null"], "max_experts=0 must be >= 1"),
    (["routing=budget", "routing.max_fraction=1.5"], "max_fraction=1.5 must be in (0, 1]"),
    (["routing=budget", "routing.max_fraction=0"], "max_fraction=0.0 must be in (0, 1]"),
    (["routing=budget", "routing.max_fraction=nan"], "max_fraction=nan must be a finite number"),
    (["routing=budget", "routing.by=votes"], "by='votes'; valid: mass, count"),
    (["routing=budget", "routing.overflow=keep"], "overflow='keep'; valid: substitute, drop"),
])
def test_bad_parameters_are_refused_by_name_when_composed(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        compose_run(overrides)


@pytest.mark.parametrize("overrides,needle", [
    (["routing=piggyback", "routing.k0=9"], "routing=piggyback: k0=9 exceeds the model's top-k 8 (k0 in 1..8"),
    (["routing=budget", "routing.max_experts=65", "routing.max_fraction=null"],
     "routing=budget: max_experts=65 exceeds the model's 64 experts per layer (1..64)"),
    (["routing=budget", "routing.max_fraction=0.01"],
     "routing=budget: max_fraction=0.01 is 0.64 of a layer's 64 experts, which rounds down to 0: at least 0.015625"),
])
def test_model_bounded_parameters_are_refused_when_the_geometry_is_known(overrides, needle):
    """Against the embedded model's geometry (64 experts, top-8), before any forward pass."""
    g = Geometry(num_layers=4, num_experts=64, top_k=8, expert_bytes=10, total_bytes=2560)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Engine(g, compose_run(overrides).spec)


def test_the_shipped_defaults_compose_and_fit_the_embedded_model():
    g = Geometry(num_layers=4, num_experts=64, top_k=8, expert_bytes=10, total_bytes=2560)
    for name in ("piggyback", "budget"):
        Engine(g, compose_run([f"routing={name}"]).spec)
    Engine(g, compose_run(["routing=budget", "routing.max_experts=16", "routing.max_fraction=null"]).spec)
    mixtral = Geometry(num_layers=4, num_experts=8, top_k=2, expert_bytes=10, total_bytes=320)
    with pytest.raises(ConfigError, match=re.escape("k0=3 exceeds the model's top-k 2")):
        Engine(mixtral, compose_run(["routing=piggyback"]).spec)  # the paper's k0 = 3 is for top-8 models
    Engine(mixtral, compose_run(["routing=piggyback", "routing.k0=1"]).spec)
    Engine(mixtral, compose_run(["routing=budget"]).spec)  # a quarter of 8: 2 = its top-k


# ---- live: a batched generation on the embedded model ------------------------------------------------------

@pytest.fixture(scope="module")
def embedded():
    from specmd.models.loader import load_model

    return load_model(compose_run([]).model)


@pytest.mark.parametrize("routing,cap", [({"name": "piggyback"}, None),
                                         ({"name": "budget", "max_experts": 12, "max_fraction": None}, 12)])
def test_a_batched_generation_on_the_embedded_model(routing, cap, embedded):
    """Two prompts decoded together: every decode layer call stays within its bound (piggyback: the union of
    the top-3 sets; budget: 12 experts), selections change (fidelity < 1), the prefill is the router's own
    (passes: decode), the cache stays consistent."""
    from specmd.hook import install

    model, tok = embedded
    a, b = (tok(p)["input_ids"] for p in ("The tower is 324 metres tall, about the same height as",
                                          "Natalia sold clips to 48 of her friends in April, and then"))
    n = min(len(a), len(b))
    ids = torch.tensor([a[:n], b[:n]])  # two sequences of one length: every token is live
    stack = install(model, spec_of(routing=routing, prefetch="none", hardware=HardwareConfig(capacity=0.05)))
    seen = []
    policy = stack.engine.routing
    route = policy.route

    def spy(rec, cache):
        routed = route(rec, cache)
        index = None if routed is None else routed.index
        ran = rec.original if index is None else index
        top3 = ranked_by_score(rec.probs, rec.original)[:, :3]
        seen.append((len(set(ran.reshape(-1).tolist())), len(set(top3.reshape(-1).tolist())), index is not None,
                     cache.pass_kind))
        return routed

    policy.route = spy
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False)
    finally:
        stack.remove()
    assert out.shape == (2, n + 3)
    assert seen and any(changed for _, _, changed, _ in seen)
    assert not any(changed for _, _, changed, kind in seen if kind == "prefill")  # passes: decode (the default)
    for distinct, base, changed, kind in seen:
        if kind == "prefill":
            continue
        assert distinct <= (cap if cap else base)
    stack.cache.check_invariants()
    assert stack.cache.stats.fidelity() < 1


# ---- the passes they act on -------------------------------------------------------------------------------

@pytest.mark.parametrize("routing,rows,k", [({"name": "piggyback", "k0": 2}, "PIGGY", 4),
                                            ({"name": "budget", "max_experts": 3, "max_fraction": None}, "BUDGET", 2)])
def test_batch_aware_routing_leaves_prefill_as_routed_unless_told(routing, rows, k):
    """``passes: decode`` (both papers: decode only): a prefill call is the router's own (fidelity 1, every
    router request served); ``passes: all`` changes it as it changes a decode step; another value is refused
    naming the choices."""
    table = globals()[rows]
    for passes, changed in (("decode", False), ("all", True)):
        did, out = one_call({**routing, "passes": passes}, record(table, k), "prefill")
        assert did is changed
        assert (out["routing"]["fidelity"] < 1) is changed
        assert (out["cache"]["requests"] < out["cache"]["requests_router"]) is changed
    with pytest.raises(ConfigError, match="passes='prefill'.*decode, all"):
        ROUTING.build({**routing, "passes": "prefill"})
