"""The family's selection rule is what every policy sees (issue 55): a selection bias (DeepSeek-V3's
``e_score_correction_bias``) and a group-limited top-k (DeepSeek-V2's ``group_limited_greedy``, V3's node
limit) decide the router's top-k, so a policy that ranks experts ranks by the selection score
(``GateRecord.scores``), and with no adjustment returns the router's own choice -- on every family, every
routing policy of the registry, and in a replay of a recorded trace as live."""

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import FAMILIES, sample_ids
from specmd.compose import spec_of
from specmd.engine.record import LiveRecord, Scoring
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.models.adapters import adapter_for, derived_families
from specmd.models.loader import build_tiny
from specmd.policies.miss import MISS
from specmd.policies.routing import ROUTING

# every family (with a record, or derived from transformers), plus DeepSeek-V2 in its group-limited reading
# (V2-Lite, the tiny default, is greedy)
VARIANTS = {f: (f, None) for f in FAMILIES + derived_families()}
VARIANTS["deepseek_v2_grouped"] = ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=8, topk_group=3))

# each routing policy with the parameters that adjust nothing: the router's own choice, exactly. A policy
# that has none says why (the registry test below fails on a policy in neither table).
NEUTRAL = {
    "standard": {},
    "max_rank": {"M": "k", "J": 0},
    "cumsum": {"p": 0.0, "J": 0},
    "cache_prior": {"lambda_": 1e-7, "J": 0},
    "prune": {"h": "k"},
    "piggyback": {"k0": "k", "passes": "all"},
    "budget": {"max_fraction": 1.0, "passes": "all"},
}
NO_NEUTRAL = {"replace_rank": "every setting replaces one rank of every token by a random expert"}
# miss policies that read scores, set to change nothing (every miss fetched)
MISS_NEUTRAL = {"drop": {"J": "k"}, "substitute": {"alpha": 0.0}}

_BUILT = {}


def biased(variant):
    """The variant's tiny model with a random selection bias on every router that holds one (seeded; large
    enough to decide most selections, as a trained DeepSeek-V3's does); cached, never hooked by a test."""
    if variant not in _BUILT:
        family, overrides = VARIANTS[variant]
        adapter = adapter_for(family)
        model = build_tiny(family, overrides)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            E = adapter.num_experts(model.config) + adapter.identity_experts(model.config)  # (every router column)
            for i in adapter.moe_layers(model):
                block = adapter.block(model, i)  # every [E] bias of the block, found here, not through the adapter:
                for name, bias in (*block.named_buffers(), *block.named_parameters()):  # a selection bias the
                    if "bias" in name.rsplit(".", 1)[-1] and bias.numel() == E and not name.startswith("experts."):
                        bias.copy_(torch.rand(bias.shape, generator=g) - 0.6)  # record misses fails the contract
                if adapter.weight_scale_attr:  # a learned per-expert weight scale (Gemma-4's), per layer its own
                    getattr(adapter.router(model, i), adapter.weight_scale_attr).copy_(
                        torch.rand(adapter.num_experts(model.config), generator=g) + 0.5)
            model(sample_ids(batch=1, seq=8))  # (warm-up: see conftest.tiny)
        _BUILT[variant] = model
    return _BUILT[variant]


def routed(variant, ids):
    """Per MoE layer: (router logits [T, E], the router's own index [T, k], its weights [T, k]) on the model's
    forward of ``ids``."""
    family, _ = VARIANTS[variant]
    model, adapter = biased(variant), adapter_for(family)
    out, handles = [], []
    for i in adapter.moe_layers(model):
        handles.append(adapter.router(model, i).register_forward_hook(lambda m, a, o: out.append((o[0], o[2], o[1]))))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return out


def neutral(params, k):
    return {key: (k if value == "k" else value) for key, value in params.items()}


def as_sets(index):
    return [set(row) for row in index.tolist()]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_selection_scores_top_k_is_the_routers_own_choice(variant):
    family, _ = VARIANTS[variant]
    model, adapter = biased(variant), adapter_for(family)
    routers = [adapter.bias_holder(model, i) for i in adapter.moe_layers(model)]
    scoring = adapter.scoring(model.config, routers, adapter.hashed(model))
    k = adapter.top_k(model.config)
    differs = 0
    for layer, (logits, index, weights) in enumerate(routed(variant, sample_ids(batch=2, seq=16))):
        if family != "phimoe":  # the weights are the family's (dual-logit reweighing is exact)
            assert torch.allclose(scoring.weigh(scoring.probs(logits), index, layer), weights.float(), rtol=1e-5,
                                  atol=1e-6)
        scores = scoring.scores_of(logits, layer, index)  # (a hash-routed layer lifts the router's own choice)
        assert as_sets(torch.topk(scores, k, dim=-1).indices) == as_sets(index)
        assert as_sets(scoring.select(logits, layer, k, index)) == as_sets(index)
        if layer in scoring.hashed:  # ... which it cannot know otherwise (DeepSeek-V4: the token's tid2eid row)
            with pytest.raises(ValueError, match="hash-routed"):
                scoring.scores_of(logits, layer)
        differs += sum(a != b for a, b in zip(as_sets(torch.topk(logits, k, dim=-1).indices), as_sets(index)))
    if not scoring.plain:  # the rule decides: the plain logits rank otherwise
        assert differs > 0
    assert scoring.plain == (all(getattr(r, adapter.bias_attr, None) is None for r in routers) and scoring.groups == 1
                             and not scoring.hashed)
    assert bool(scoring.hashed) == (family == "deepseek_v4")  # (its first layers: mlp_layer_types "hash_moe")
    if family == "deepseek_v3" or variant == "deepseek_v2_grouped":
        assert not scoring.plain


def test_every_routing_policy_has_a_neutral_setting_or_says_why_not():
    assert set(NEUTRAL) | set(NO_NEUTRAL) == set(ROUTING.names())
    assert not set(NEUTRAL) & set(NO_NEUTRAL)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_policy_with_no_adjustment_runs_the_routers_own_choice(variant):
    """Registry x families: each routing policy at its neutral setting (and the score-reading miss policies)
    keeps routing fidelity 1.0 on a biased / group-limited router, with a cache that holds experts (so a
    promotion could happen). Before issue 55 max_rank M = k gave 0.2 on the biased DeepSeek-V3."""
    family, _ = VARIANTS[variant]
    if family == "phimoe":
        pytest.skip("sparsemixer selects by its own jittered rule, which no selection score models (reweigh_note)")
    model = biased(variant)
    k = adapter_for(family).top_k(model.config)
    ids = sample_ids(batch=2, seq=12, seed=3)
    cases = [dict(routing={"name": n, **neutral(p, k)}) for n, p in NEUTRAL.items()]
    cases += [dict(miss={"name": n, **neutral(p, k)}) for n, p in MISS_NEUTRAL.items()]
    for case in cases:
        spec = spec_of(hardware=HardwareConfig(capacity=0.3), prefetch="none", **case)
        with install(model, spec, adapter_for(family)) as stack, torch.no_grad():
            model(ids)
            model(ids[:, :1])  # (a second pass: the cache now holds the first's experts)
        assert stack.cache.stats.fidelity() == 1.0, (variant, case)


def record(probs, bias=None, k=1, **groups):
    """A hand-made layer call of one token: softmax probabilities ``probs`` (their logs as logits), a
    selection bias, group limits; its index the rule's own top-k."""
    probs = torch.tensor([probs])
    scoring = Scoring(False, False, 1.0, None if bias is None else torch.tensor([bias]), **groups)
    index = torch.topk(scoring.selection(probs, 0), k, dim=-1).indices
    return LiveRecord(0, probs.log(), scoring.weigh(probs, index), index, scoring)


class Cache:
    def __init__(self, present):
        self._present = list(present)

    def present(self, layer):
        return self._present

    resident = present


def test_max_rank_promotes_within_the_selection_ranks_hand_worked():
    # probs rank 0 > 1 > 2 > 3; the bias lifts expert 2 to the top: the router selects 2 (k = 1)
    rec = record([0.4, 0.3, 0.2, 0.1], bias=[0.0, 0.0, 0.5, 0.0])
    assert rec.index.tolist() == [[2]] and rec.scores[0].tolist() == pytest.approx([0.4, 0.3, 0.7, 0.1])
    pol = ROUTING.build({"name": "max_rank", "M": 2, "J": 0})
    # selection ranks [2, 0, 1, 3]: the top 2 are {2, 0}; cached 1 is rank 2, outside M -> unchanged
    assert pol.apply(rec, Cache([1])).tolist() == [[2]]  # (ranking the logits promoted 1: rank 1 of [0, 1, 2, 3])
    assert pol.apply(rec, Cache([0])).tolist() == [[0]]  # cached 0 at selection rank 1 < M: promoted


def test_a_group_limit_is_never_crossed_hand_worked():
    # groups {0, 1} and {2, 3}, one kept, a group scored by its best: group 0 (0.35) beats group 1 (0.3)
    rec = record([0.35, 0.05, 0.3, 0.3], k=2, groups=2, topk_group=1, group_score="max")
    assert as_sets(rec.index) == [{0, 1}]
    assert rec.scores[0, 2:].tolist() == [float("-inf")] * 2
    # max_rank searching every rank: cached 2 is outside the token's groups, so never promoted
    assert as_sets(ROUTING.build({"name": "max_rank", "M": 4, "J": 0}).apply(rec, Cache([2]))) == [{0, 1}]
    # cache_prior: the boost competes for the group, the limit holds (one group's experts)
    prior = ROUTING.build({"name": "cache_prior", "lambda_": 1.0, "J": 0})
    prior.setup(SimpleNamespace(num_layers=1))
    out = prior.apply(rec, Cache([2, 3]))
    assert as_sets(out) in ([{0, 1}], [{2, 3}])
    assert as_sets(out) == [{2, 3}]  # lambda 1: the cached pair's boosted group wins


def test_miss_policies_rank_misses_by_the_selection_score_hand_worked():
    # the bias makes expert 3 the top-1 although its probability is the lowest of the selected
    rec = record([0.4, 0.3, 0.2, 0.1], bias=[0.0, 0.0, 0.0, 0.6], k=2)
    assert as_sets(rec.index) == [{3, 0}]
    drop = MISS.build({"name": "drop", "J": 1})
    out = drop.handle(0, [0, 3], rec, Cache([]))
    assert [type(o).__name__ for o in out] == ["Dropped", "Fetched"]  # 3 is rank 0, 0 is rank 1
    from specmd.policies.miss.base import expert_scores

    assert expert_scores(rec, [0, 3]).tolist() == pytest.approx([0.4, 0.7])


def test_the_rule_round_trips_through_a_trace_meta_and_bad_rules_are_refused():
    bias = torch.tensor([[0.1, -0.2, 0.3, 0.0], [0.0, 0.0, 0.0, 0.5]])
    s = Scoring(True, True, 2.5, bias, groups=2, topk_group=1)
    back = Scoring.from_dict(s.to_dict(), 2, 4)
    assert torch.equal(back.bias, bias) and (back.groups, back.topk_group, back.group_score) == (2, 1, "top2")
    assert back.sigmoid and back.renorm and back.scale == 2.5
    old = Scoring.from_dict({"sigmoid": True, "renorm": True, "scale": 1.0})  # a trace from before the rule
    assert old.plain and old.bias is None
    with pytest.raises(ValueError, match="shape"):
        Scoring.from_dict(s.to_dict(), 3, 4)
    with pytest.raises(ValueError, match="non-finite"):
        Scoring(True, True, 1.0, torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="group_score='sum'"):
        Scoring(True, True, 1.0, None, 2, 1, "sum")
    with pytest.raises(ValueError, match="topk_group=3"):
        Scoring(True, True, 1.0, None, 2, 3)
    assert Scoring(True, True, 1.0, torch.zeros(2, 4)).plain  # an all-zero bias selects as none


def test_replay_of_a_cache_aware_stack_on_a_biased_router_equals_live(tmp_path):
    """The trace stores the selection rule, so replay ranks as live did (exact where the stack is:
    max_rank's promotions read only the cache and the selection scores)."""
    from specmd.replay.driver import run_replay
    from specmd.replay.trace import read_trace
    from tests.replay.test_replay import live

    model = biased("deepseek_v3")
    prompts = [sample_ids(batch=1, seq=10, seed=s) for s in (0, 1)]
    base = dict(hardware=HardwareConfig(capacity=0.3), prefetch="none")
    live(model, spec_of(**base), prompts, tmp_path / "trace", depth=1)
    trace = read_trace(tmp_path / "trace")
    assert trace.meta.scoring.bias is not None and trace.meta.scoring.groups == 8
    spec = spec_of(routing={"name": "max_rank", "M": 16, "J": 1}, **base)
    want = live(model, spec, prompts)
    got = run_replay(trace, spec).results()
    assert want["routing"]["fidelity"] < 1.0  # promotions happened
    assert got["cache"] == want["cache"] and got["routing"] == want["routing"]


def test_an_overfetch_holds_the_routers_own_choice_on_a_biased_router():
    """prefetch=topk with overfetch > 1 on a biased router: the predicted experts of the target layer contain
    the target router's own top-k (ranked by probability alone, the bias's choices fell out)."""
    from specmd.policies.prefetch.base import topk_prediction

    model, adapter = biased("deepseek_v3"), adapter_for("deepseek_v3")
    moe = adapter.moe_layers(model)
    routers = [adapter.bias_holder(model, i) for i in moe]
    scoring = adapter.scoring(model.config, routers)
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _, own = adapter.router(model, moe[1])(hidden)
    rec = LiveRecord(0, logits, None, own, scoring, signal=lambda target: (logits, own))
    k = own.shape[-1]
    predicted = topk_prediction(rec, 1, k + 4)  # overfetch 1.5
    assert set(own[0].tolist()) <= set(predicted) and len(predicted) == k + 4


def test_a_left_out_group_scores_what_the_family_fills_hand_worked():
    # groups {0, 1} and {2, 3}, one kept, scored by the best: group 1 (-0.1) beats group 0 (-0.2); every score
    # negative. transformers' DeepSeek-V3 router fills group 0 with -inf: top-2 = {2, 3}. A.X-K2's fills 0.0,
    # above every kept score: its top-2 is group 0's experts, the group it left out -- reproduced, not corrected
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.2]])
    bias = torch.tensor([[-0.3, -0.4, -0.4, -0.45]])
    for fill, want in ((float("-inf"), {2, 3}), (0.0, {0, 1})):
        s = Scoring(True, False, 1.0, bias, groups=2, topk_group=1, group_score="max", group_fill=fill)
        assert set(torch.topk(s.selection(probs, 0), 2).indices[0].tolist()) == want
    assert s.selection(probs, 0)[0, :2].tolist() == [0.0, 0.0]


def test_probabilities_given_and_a_per_expert_weight_scale_hand_worked():
    # Gemma-4: the router's first output is its softmax; weights renormalised, then times per_expert_scale
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    scale = torch.tensor([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]])
    s = Scoring(False, True, 1.0, given=True, expert_scale=scale)
    assert torch.equal(s.probs(probs), probs)  # taken as it is, not softmaxed again
    index = torch.tensor([[0, 2]])
    assert s.weigh(probs, index, 0)[0].tolist() == pytest.approx([0.5 / 0.7 * 1.0, 0.2 / 0.7 * 4.0])
    assert s.weigh(probs, index, 1)[0].tolist() == pytest.approx([0.5 / 0.7 * 3.0, 0.2 / 0.7 * 3.0])
    with pytest.raises(ValueError, match="per MoE layer"):  # (no silent layer 0)
        s.weigh(probs, index)
    assert s.plain and torch.equal(s.selection(probs, 0), probs)  # the scale weighs, never selects
    back = Scoring.from_dict(s.to_dict(), 2, 3)  # (a trace's meta.json)
    assert back.given and torch.equal(back.expert_scale, scale) and back.group_fill == float("-inf")
    fill = Scoring.from_dict(Scoring(True, True, 1.0, None, 2, 1, group_fill=0.0).to_dict(), 1, 4)
    assert fill.group_fill == 0.0
    with pytest.raises(ValueError, match="scoring.expert_scale has shape"):
        Scoring.from_dict(s.to_dict(), 3, 3)
    with pytest.raises(ValueError, match="per-expert weight scale has non-finite"):
        Scoring(False, True, 1.0, expert_scale=torch.tensor([[float("inf"), 1.0]]))
    with pytest.raises(ValueError, match="group_fill=nan"):
        Scoring(False, True, 1.0, group_fill=float("nan"))


def test_a_selection_bias_on_the_logits_hand_worked():
    # Kolibri adds its bias to the logits: logits [2, 0], bias [0, 0.5] -> 2.0 vs 0.5, expert 0 selected; on
    # the sigmoid probabilities (0.88 vs 0.5 + 0.5 = 1.0) expert 1 would be
    logits, bias = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.5]])
    assert Scoring(True, True, 1.0, bias).select(logits, 0, 1).tolist() == [[1]]
    on = Scoring(True, True, 1.0, bias, on_logits=True)
    assert on.select(logits, 0, 1).tolist() == [[0]] and on.scores_of(logits, 0).tolist() == [[2.0, 0.5]]
    rec = LiveRecord(0, logits, on.weigh(on.probs(logits), torch.tensor([[0]])), torch.tensor([[0]]), on)
    assert rec.scores.tolist() == [[2.0, 0.5]]  # what every ranking policy reads
    assert Scoring.from_dict(on.to_dict(), 1, 2).on_logits


def test_a_hash_routed_layer_keeps_the_tokens_choice_and_ranks_the_rest_by_the_gate_hand_worked():
    # DeepSeek-V4's hash layers choose tid2eid[token]; the gate's probabilities only weigh. Layer 0 hashed: the
    # token's choice {1, 3} lifted by max - min + 1 = 0.9 - 0.1 + 1 = 1.8 above every other expert -> [0.9, 1.9,
    # 0.5, 2.0]: its top-2 is the choice, its third the gate's best other (0); layer 1 is not hashed
    from specmd.policies.prefetch.base import topk_prediction

    s = Scoring(False, True, 1.0, given=True, hashed=(0,))
    probs, chosen = torch.tensor([[0.9, 0.1, 0.5, 0.2]]), torch.tensor([[1, 3]])
    assert s.selection(probs, 0, chosen)[0].tolist() == pytest.approx([0.9, 1.9, 0.5, 2.0])
    assert s.select(probs, 0, 3, chosen)[0].tolist() == [3, 1, 0] and not s.plain
    assert torch.equal(s.selection(probs, 1), probs)  # (no bias, no groups: layer 1 ranks its probabilities)
    with pytest.raises(ValueError, match="MoE layer 0 is hash-routed"):
        s.selection(probs, 0)
    rec = LiveRecord(0, probs, None, chosen, s)  # a record's scores lift its router's own choice
    assert rec.scores[0].tolist() == pytest.approx([0.9, 1.9, 0.5, 2.0])
    rec = LiveRecord(1, probs, None, chosen, s, signal=lambda target: (probs, chosen))
    assert set(topk_prediction(rec, 0, 3)) == {1, 3, 0}  # an overfetch at a hash layer holds the token's choice
    # sqrt-softplus probabilities (DeepSeek-V4's scoring_func): sqrt(log(1 + e^x)): sqrt(log 2), sqrt(2.126928)
    soft = Scoring(False, True, 1.0, sqrt_softplus=True)
    assert soft.probs(torch.tensor([[0.0, 2.0]]))[0].tolist() == pytest.approx([0.832555, 1.458399], rel=1e-5)
    assert soft.elementwise and not Scoring(False, True, 1.0).elementwise
    back = Scoring.from_dict(Scoring(False, True, 2.5, sqrt_softplus=True, hashed=(0, 2)).to_dict(), 3, 4)
    assert back.sqrt_softplus and back.hashed == {0, 2} and back.scale == 2.5  # (a trace's meta.json)
    for bad in ([3], [-1], "0", [0.5]):
        with pytest.raises(ValueError, match="scoring.hashed"):
            Scoring.from_dict({"sigmoid": False, "hashed": bad}, 3, 4)
    with pytest.raises(ValueError, match="hashed=.*MoE layer ordinals"):
        Scoring(False, True, 1.0, hashed=(-1,))
