"""The shipped embedded model: loads offline, matches its model card, routes non-degenerately."""

import json

import pytest

from specmd.models.loader import ASSETS, ModelConfig, load_model

CARD = json.loads((ASSETS / "tiny-olmoe" / "card.json").read_text())


@pytest.fixture(scope="module")
def shipped():
    return load_model(ModelConfig(name="tiny", family="olmoe", pretrained="specmd:tiny-olmoe", dtype="float32"))


def test_assets_small_enough():
    size = sum(p.stat().st_size for p in (ASSETS / "tiny-olmoe").iterdir())
    assert size <= 30 * 2**20, size


def test_perplexity_matches_model_card(shipped, mirror):
    from specmd.eval.harness import EvalConfig, evaluate
    from specmd.eval.mirror import mirrored

    model, tok = shipped
    ref = CARD["check"]  # a fixed slice, recorded when the card was made
    with mirrored(mirror):
        res = evaluate(model, tok, EvalConfig(tasks=["wikitext"], limit=ref["limit"]))
    assert res["wikitext"]["word_perplexity"] == pytest.approx(ref["word_perplexity"], rel=0.01)


def test_routing_is_trained_not_degenerate(shipped, mirror):
    from specmd.modelcard import routing_stats, wikitext_test_pages

    model, tok = shipped
    stats = routing_stats(model, tok, wikitext_test_pages(mirror), max_tokens=8192)
    assert all(r >= 0.85 for r in stats["entropy_ratio"]), stats
    assert all(d == 0 for d in stats["dead_fraction"]), stats
    # trained routing has temporal locality well above independent routing (k/E)
    assert all(o > 1.5 * stats["random_overlap"] for o in stats["temporal_overlap"]), stats
