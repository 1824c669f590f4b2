"""Batches (docs/semantics.md "Batches and concurrency"): a batched pass is one step over the live tokens;
pad positions and finished sequences are no requests -- not counted, not fetched, not timed -- and a lossless
stack stays bit-equal to the unhooked model at the same batch, offload equal to simulated, replay to live."""

import pytest
import torch

from tests.conftest import FAMILIES, at_equal_threads, sample_ids, tiny
from specmd.compose import spec_of
from specmd.engine.batch import batched_context, independent_union
from specmd.executor import EXECUTION
from specmd.hardware import HardwareConfig
from specmd.hook import install
from specmd.models.adapters import adapter_for
from specmd.replay.driver import exactness, run_replay
from specmd.replay.trace import TraceWriter, read_trace


def _spec(execution="simulated", capacity=0.05, prefetch="topk", **kw):
    spec = spec_of(prefetch=prefetch, hardware=HardwareConfig(capacity=capacity), **kw)
    spec.execution = EXECUTION.params(at_equal_threads({"name": execution, "check": True} if execution == "offload"
                                                       else {"name": execution}))
    return spec


def left_padded(lengths, seed=0, pad=0):
    """A left-padded batch: ids [B, S] and its attention mask (1 = a real token)."""
    S = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), S), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, S - n:] = torch.randint(1, 256, (n,), generator=g)
        mask[b, S - n:] = 1
    return ids, mask


def router_topk(model, family, fn):
    """Per MoE layer, the router's own top-k [rows, k] of every forward pass ``fn`` runs (unhooked)."""
    adapter = adapter_for(family)
    geom = adapter.geometry(model)
    seen = {l: [] for l in range(geom.num_layers)}
    handles = [adapter.router(model, i).register_forward_hook(
        lambda m, a, out, l=l: seen[l].append(out[2].reshape(-1, out[2].shape[-1]).clone()))
        for l, i in enumerate(geom.layer_ids)]
    try:
        with torch.no_grad():
            fn()
    finally:
        for h in handles:
            h.remove()
    return seen


# ---------------------------------------------------------------------------------------------------------
# the rules, hand-worked
# ---------------------------------------------------------------------------------------------------------

def test_batched_context_is_the_token_weighted_mean():
    assert batched_context([7], [31]) == 31  # one sequence: its own
    assert batched_context([5, 2, 4], [5, 2, 4]) == 4  # (25 + 4 + 16) / 11 = 4.09
    assert batched_context([1, 1], [10, 13]) == 12  # 11.5 rounds half up
    assert batched_context([1, 0, 1], [10, 99, 12]) == 11  # a sequence without a live token does not count
    assert batched_context([0], [5]) == 0


def test_independent_union_is_the_issues_figures():
    assert independent_union(64, 8, 1) == pytest.approx(8)
    assert independent_union(64, 8, 8) / 64 == pytest.approx(0.656, abs=1e-3)  # OLMoE's shape: 66% at batch 8
    assert independent_union(64, 8, 32) / 64 == pytest.approx(0.986, abs=1e-3)  # 99% at 32
    assert independent_union(60, 4, 8) / 60 == pytest.approx(0.425, abs=1e-3)  # Qwen1.5-MoE: 42% at 8
    assert independent_union(60, 4, 32) / 60 == pytest.approx(0.890, abs=1e-3)  # 89% at 32


def test_pads_and_finished_sequences_are_no_requests():
    """Three prompts of 5, 2 and 4 tokens left-padded to 5: the prefill routes 11 tokens, and each layer call
    requests the union of the live positions' top-k only; a decode step after the second sequence finished
    routes 2 tokens; a right-padded scoring batch routes its true lengths; a step with every sequence
    finished is no pass at all."""
    family = "olmoe"
    model = tiny(family)
    ids, mask = left_padded([5, 2, 4], seed=3)
    ref = router_topk(model, family, lambda: model(ids, attention_mask=mask))
    live = mask.reshape(-1).bool()
    geom = adapter_for(family).geometry(model)
    k, L = geom.top_k, geom.num_layers
    with torch.no_grad():
        unhooked = model(ids, attention_mask=mask, use_cache=True)
        nxt = torch.tensor([[7], [8], [9]])
        mask2 = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        dec_ref = router_topk(model, family, lambda: model(nxt, attention_mask=mask2,
                                                           past_key_values=_copy(unhooked.past_key_values)))
        stack = install(model, _spec(capacity=1.0, prefetch="none"))
        try:
            out = model(ids, attention_mask=mask, use_cache=True)
            st = stack.cache.stats
            assert torch.equal(out.logits, unhooked.logits)  # simulated computes pads as the model does
            p = st.passes[-1]
            assert (p.kind, p.tokens) == ("prefill", 11)
            assert st.slots_total == 11 * k * L  # per layer 11 live tokens x k; the 4 pads' selections are not counted
            for layer, rows in ref.items():
                union = set(rows[0][live].reshape(-1).tolist())
                assert st.requests[layer] == len(union), layer  # exact: live positions only
                if set(rows[0].reshape(-1).tolist()) != union:  # the pads route elsewhere too: the rule bites
                    assert st.requests[layer] < len(set(rows[0].reshape(-1).tolist()))
            assert stack.engine.cache.stats.passes[-1].requests == sum(st.requests)
            # one decode step, the second sequence finished: its row is no request
            before = list(st.requests)
            stack.live.finish([False, True, False])
            model(nxt, attention_mask=mask2, past_key_values=out.past_key_values)
            p = st.passes[-1]
            assert (p.kind, p.tokens) == ("decode", 2)
            for layer, rows in dec_ref.items():
                assert st.requests[layer] - before[layer] == len(set(rows[0][[0, 2]].reshape(-1).tolist()))
            # every sequence finished: no pass, no request
            n, total = len(st.passes), sum(st.requests)
            stack.live.finish([True, True, True])
            mask3 = torch.cat([mask2, torch.ones(3, 1, dtype=torch.long)], 1)
            model(nxt, attention_mask=mask3, past_key_values=out.past_key_values)
            assert len(st.passes) == n and sum(st.requests) == total
            # a right-padded scoring batch (no mask: lm-eval's): the driver says the true lengths
            ids4 = sample_ids(batch=2, seq=6, seed=4)
            stack.live.expect(torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool))
            model(ids4)
            p = st.passes[-1]
            assert (p.kind, p.tokens) == ("prefill", 9)
            model(ids4)  # the mask was for one pass only
            assert st.passes[-1].tokens == 12
        finally:
            stack.remove()
    stack.cache.check_invariants()


def _copy(past):
    import copy

    return copy.deepcopy(past)


# ---------------------------------------------------------------------------------------------------------
# equalities: the unhooked model, offload, replay
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [2, 4])
def test_lossless_batched_generation_is_bit_equal_to_the_unhooked_model(family, batch):
    model = tiny(family)
    lengths = [6, 3, 5, 2][:batch]
    ids, mask = left_padded(lengths, seed=batch)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             pad_token_id=0)
        ref_logits = model(ids, attention_mask=mask).logits
        with install(model, _spec(capacity=0.05)) as stack:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                 pad_token_id=0)
            logits = model(ids, attention_mask=mask).logits
    assert torch.equal(out, ref)
    assert torch.equal(logits, ref_logits)
    passes = stack.cache.stats.passes
    assert [(p.kind, p.tokens) for p in passes] == ([("prefill", sum(lengths))] + [("decode", batch)] * 2
                                                   + [("prefill", sum(lengths))])
    stack.cache.check_invariants()


@pytest.mark.parametrize("family,miss", [("olmoe", "fetch"), ("mixtral", "fetch"), ("qwen2_moe", "drop"),
                                         ("gpt_oss", "cpu_compute"), ("deepseek_v3", "fetch")])
def test_offload_equals_simulated_at_batch_4(family, miss):
    """Live positions bit for bit, and every engine decision; pads and the finished sequence included in
    the batch as an lm-eval generation leaves them."""
    model = tiny(family)
    ids, mask = left_padded([6, 3, 5, 2], seed=7)
    out = {}
    for execution in ("simulated", "offload"):
        spec = _spec(execution, capacity=0.15, miss=miss)
        with torch.no_grad():
            stack = install(model, spec, adapter_for(family))
            try:
                first = model(ids, attention_mask=mask, use_cache=True)
                stack.live.finish([False, False, True, False])
                nxt = first.logits[:, -1].argmax(-1, keepdim=True)
                mask2 = torch.cat([mask, torch.ones(4, 1, dtype=torch.long)], 1)
                second = model(nxt, attention_mask=mask2, past_key_values=first.past_key_values)
                out[execution] = (first.logits, second.logits, stack.engine.results())
            finally:
                stack.remove()
    sim, off = out["simulated"], out["offload"]
    # every position: offload computes a pad row's experts as the model does (those no live row runs from
    # the host tier), so even pad and finished rows are equal
    assert torch.equal(off[0], sim[0])
    assert torch.equal(off[1], sim[1])
    assert off[2] == sim[2]
    assert sim[2]["cache"]["requests"] > 0


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_a_recorded_batched_run_replays_exactly(family, tmp_path):
    model = tiny(family)
    ids, mask = left_padded([7, 4, 6], seed=11)
    spec = _spec(capacity=0.1)
    stack = install(model, spec)
    stack.writer = TraceWriter(tmp_path / "trace", stack.geom, stack.scoring, stack.store, 1)
    with torch.no_grad(), stack:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=0)
        stack.live.expect(torch.tensor([[1] * 5, [1, 1, 0, 0, 0]], dtype=torch.bool))
        model(sample_ids(batch=2, seq=5, seed=2))
    stack.writer.close()
    want = stack.engine.results()
    trace = read_trace(tmp_path / "trace")
    assert trace.passes[:, 1].tolist() == [17, 3, 3, 3, 7]
    assert trace.passes[:, 2].tolist()[0] == batched_context([7, 4, 6], [7, 4, 6])
    assert not exactness(trace, spec)
    got = run_replay(trace, spec).results()
    assert got["cache"] == want["cache"]
    assert got["timing"] == want["timing"]
    assert got["routing"] == want["routing"]


# ---------------------------------------------------------------------------------------------------------
# lm-eval's batches: right padding of a scoring batch, sequences that stop before the others
# ---------------------------------------------------------------------------------------------------------

def test_a_stopped_sequence_is_told_to_the_stack():
    """specmd's stopping criterion marks a sequence finished once lm-eval's stop string was seen for it (lm-eval
    stops the batch only when all are done) or it generated the end-of-sequence token; it never stops one."""
    from specmd.eval.harness import _finished_tracker
    from specmd.hook.live import LiveTokens

    class Stop:
        done_tracker = [False, False, False]

    live, stop = LiveTokens(), Stop()
    crit = _finished_tracker(live, [stop], eos=[2, 5], batch=3)
    ids = torch.tensor([[1, 9], [1, 9], [1, 9]])
    assert not crit(ids, None).any()
    assert live._finished.tolist() == [False, False, False]
    stop.done_tracker[1] = True
    crit(torch.tensor([[1, 9], [1, 9], [1, 5]]), None)  # row 2 generated an end-of-sequence token
    assert live._finished.tolist() == [False, True, True]
    crit(torch.tensor([[1, 9], [1, 0], [1, 0]]), None)  # finished stays finished
    assert live._finished.tolist() == [False, True, True]


def test_lm_eval_batches_count_live_tokens_and_stay_lossless(mirror):
    """Through lm-eval at batch 2: TruthfulQA's right-padded answers count their true lengths (a pass has
    fewer tokens than its padded shape) and the scores equal the unhooked model's; GSM8K's
    generation counts at most 2 tokens a decode step and its scores equal the unhooked model's."""
    from specmd.eval.harness import EvalConfig, evaluate
    from specmd.eval.mirror import mirrored
    from specmd.models.tokenizer import byte_tokenizer

    model = tiny("olmoe")
    for cfg in (EvalConfig(tasks=["truthfulqa"], limit=2, batch_size=2),
                EvalConfig(tasks=["gsm8k"], limit=3, max_gen_toks=6, batch_size=2)):
        shapes = []
        h = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)
        try:
            with mirrored(mirror):
                ref = evaluate(model, byte_tokenizer(), cfg)
                shapes.clear()
                with make(model) as stack:
                    hooked = evaluate(model, byte_tokenizer(), cfg, live=stack.live)
        finally:
            h.remove()
        assert hooked == ref
        passes = stack.cache.stats.passes
        padded = sum(b * s for b, s in shapes)
        assert sum(p.tokens for p in passes) <= padded
        if cfg.tasks == ["truthfulqa"]:
            assert sum(p.tokens for p in passes) < padded  # answers of different lengths were padded
        else:
            assert all(p.tokens <= 2 for p in passes if p.kind == "decode")


def make(model):
    return install(model, _spec(capacity=0.1))


# ---------------------------------------------------------------------------------------------------------
# union accounting and the oracle, hand-worked
# ---------------------------------------------------------------------------------------------------------

def _batched_trace():
    """Two MoE layers, 4 experts, top-2. Pass 0 (prefill, 3 tokens); pass 1 (decode, 2 live tokens): layer 0
    rows [0,1],[1,2] -> union {0,1,2}; layer 1 [3,0],[3,0] -> {0,3}. Pass 2 (decode, 1 token): [0,1] -> 2,
    [2,3] -> 2."""
    import numpy as np

    from specmd.engine import Geometry
    from specmd.engine.store import StoreSizes
    from specmd.replay.trace import Trace, TraceMeta, full_calls

    passes = np.array([[0, 3, 3], [1, 2, 4], [1, 1, 5]], dtype=np.int64)
    rows = [[0, 1], [2, 3], [1, 2],  [0, 1], [0, 1], [0, 1],  # prefill: layer 0, layer 1
            [0, 1], [1, 2], [3, 0], [3, 0],  # decode 1
            [0, 1], [2, 3]]  # decode 2
    geom = Geometry(num_layers=2, num_experts=4, top_k=2, expert_bytes=100, total_bytes=800)
    meta = TraceMeta(geometry=geom, store=StoreSizes(16, 100, {}), logits="none", source={"format": "test"})
    return Trace(meta=meta, passes=passes, calls=full_calls(passes, 2), index=np.asarray(rows, dtype=np.uint8))


def test_union_accounting_on_a_hand_worked_trace():
    trace = _batched_trace()
    spec = spec_of(prefetch="none", hardware=HardwareConfig(experts_per_layer=2, scope="per_layer"))
    u = run_replay(trace, spec).results()["cache"]["union"]
    d = u["decode"]
    assert d["steps"] == 2 and d["tokens_per_step"] == 1.5
    assert d["distinct_per_layer"] == {"mean": 2.25, "p50": 2.25, "p95": pytest.approx(2.475)}  # steps: 2.5, 2.0
    assert d["fraction"] == 2.25 / 4
    assert d["independent_per_layer"] == pytest.approx((4 * (1 - 0.5 ** 2) + 2) / 2)  # b=2: 3; b=1: 2
    assert d["sharing"] == pytest.approx(1 - 2.25 / 2.5)
    assert d["loads_per_token"] == 9 / 3  # 5 + 4 distinct experts over 3 live tokens
    p = u["prefill"]  # layer 0: {0,1,2,3} = 4; layer 1: {0,1} = 2
    assert p["steps"] == 1 and p["distinct_per_layer"]["mean"] == 3.0 and p["loads_per_token"] == 2.0
    assert u["by_layer"] == [(4 + 3 + 2) / 3, (2 + 2 + 2) / 3]
    assert u["bytes_per_token"] == 100 * run_replay(trace, spec).results()["cache"]["misses"] / 6
    assert u["static_share"] == 4 / 8  # two pools of 2 slots over 2 x 4 experts


def test_the_oracle_is_belady_on_the_same_requests():
    from specmd.replay.driver import oracle_rates

    trace = _batched_trace()
    spec = spec_of(prefetch="none", hardware=HardwareConfig(experts_per_layer=2, scope="per_layer"))
    lru = run_replay(trace, spec).results()["cache"]
    bel = run_replay(trace, spec_of(eviction="belady", prefetch="none",
                                    hardware=HardwareConfig(experts_per_layer=2, scope="per_layer"))).results()["cache"]
    got = oracle_rates(trace, spec)
    assert got["eviction"] == "belady" and got["exact"] is True
    assert got["hit_rate"] == bel["hit_rate"] >= lru["hit_rate"]
    assert got["decode_hit_rate"] == bel["decode_hit_rate"]
