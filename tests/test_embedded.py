"""The shipped embedded models: each loads offline, matches its model card, routes non-degenerately."""

import json

import pytest

from specmd.models.loader import ASSETS, ModelConfig, load_model

# asset -> (family, size limit in MiB, MoE layers, experts, top-k, ships eviction=ml networks). The
# Mixtral-shaped model (specmd/conf/train_deep_mixtral.yaml) joins when it meets the card's routing bounds.
SHIPPED = {
    "tiny-olmoe": ("olmoe", 30, 4, 64, 8, True),
    "deep-olmoe": ("olmoe", 40, 16, 64, 8, True),
}


@pytest.fixture(scope="module", params=list(SHIPPED))
def shipped(request):
    name = request.param
    family = SHIPPED[name][0]
    model, tok = load_model(ModelConfig(name=name, family=family, pretrained=f"specmd:{name}", dtype="float32"))
    return name, model, tok


@pytest.mark.parametrize("name", list(SHIPPED))
def test_assets_small_enough_and_shaped_as_promised(name):
    family, mib, layers, experts, top_k, ml = SHIPPED[name]
    size = sum(p.stat().st_size for p in (ASSETS / name).iterdir())
    assert size <= mib * 2**20, size
    config = json.loads((ASSETS / name / "config.json").read_text())
    assert config["model_type"] == family and config["num_hidden_layers"] == layers
    assert config.get("num_experts", config.get("num_local_experts")) == experts
    assert config["num_experts_per_tok"] == top_k
    assert (ASSETS / name / "ml_eviction.safetensors").is_file() == ml  # eviction=ml's networks for this model


def test_perplexity_matches_model_card(shipped, mirror):
    from specmd.eval.harness import EvalConfig, evaluate
    from specmd.eval.mirror import mirrored

    name, model, tok = shipped
    ref = json.loads((ASSETS / name / "card.json").read_text())["check"]  # a fixed slice, recorded with the card
    with mirrored(mirror):
        res = evaluate(model, tok, EvalConfig(tasks=["wikitext"], limit=ref["limit"]))
    assert res["wikitext"]["word_perplexity"] == pytest.approx(ref["word_perplexity"], rel=0.01)


def test_routing_is_trained_not_degenerate(shipped, mirror):
    from specmd.modelcard import routing_stats, wikitext_test_pages

    _, model, tok = shipped
    stats = routing_stats(model, tok, wikitext_test_pages(mirror), max_tokens=8192)
    assert all(r >= 0.85 for r in stats["entropy_ratio"]), stats
    assert all(d == 0 for d in stats["dead_fraction"]), stats
    # trained routing has temporal locality well above independent routing (k/E)
    assert all(o > 1.5 * stats["random_overlap"] for o in stats["temporal_overlap"]), stats
