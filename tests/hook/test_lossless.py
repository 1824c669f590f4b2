"""A lossless stack (standard routing, fetch, any eviction/prefetch, any capacity) must not change outputs."""

import pytest
import torch

from tests.conftest import FAMILIES, make_stack, sample_ids, tiny


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("capacity", [0.05, 1.0])
def test_hooked_logits_equal_unhooked(family, capacity):
    model = tiny(family)
    ids = sample_ids()
    with torch.no_grad():
        ref = model(ids).logits
        with make_stack(model, family, capacity=capacity) as stack:
            out = model(ids).logits
    assert torch.equal(out, ref)
    st = stack.cache.stats
    assert st.total("requests") > 0
    assert st.total("hits") + st.total("misses") == st.total("requests")
    assert stack.cache.stats.fidelity() == 1.0
    stack.cache.check_invariants()
    # the stack is fully removed afterwards
    assert all(type(l.mlp.experts).__name__ != "SpecmdExperts" for l in model.model.layers if hasattr(l.mlp, "experts"))


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_equal_and_decode_passes(family):
    model = tiny(family)
    ids = sample_ids(batch=1, seq=8, seed=1)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=5, do_sample=False)
        with make_stack(model, family, capacity=0.05) as stack:
            out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    timing = stack.cache.stats.timing()
    assert timing["prefill_passes"] == 1 and timing["decode_passes"] == 4
    assert timing["ttft_s"] > 0 and timing["tpot_s"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_perplexity_equal_through_lm_eval(family, mirror):
    from specmd.eval.harness import EvalConfig, evaluate
    from specmd.eval.mirror import mirrored
    from specmd.models.tokenizer import byte_tokenizer

    model = tiny(family)
    cfg = EvalConfig(tasks=["wikitext"], limit=1, max_length=256)
    with mirrored(mirror):
        ref = evaluate(model, byte_tokenizer(), cfg)
        with make_stack(model, family, capacity=0.05):
            hooked = evaluate(model, byte_tokenizer(), cfg)
    assert hooked["wikitext"]["word_perplexity"] == ref["wikitext"]["word_perplexity"]
    assert ref["wikitext"]["word_perplexity"] > 1


def test_reweigh_reproduces_router_weights():
    """Dual-logit weights of the router's own selection equal the router's weights (all families whose
    weighting reweigh() models exactly; PhiMoE's sparsemixer is the documented exception)."""
    from specmd.models.adapters import adapter_for

    for family in FAMILIES:
        if adapter_for(family).reweigh_note:
            continue
        model = tiny(family)
        with make_stack(model, family) as stack:
            with torch.no_grad():
                model(sample_ids(batch=1, seq=16))
            for rec in stack.records:
                torch.testing.assert_close(rec.reweigh(rec.index), rec.weights.float().to(rec.weights.dtype),
                                           rtol=1e-5, atol=1e-6, msg=family)
