"""The shipped embedded models: each loads offline, matches its model card, routes non-degenerately."""

import json

import pytest

from specmd.commands.card import routing_failures
from specmd.models.loader import ASSETS, ModelConfig, load_model

# asset -> (family, size limit in MiB, MoE layers, experts, top-k, ships eviction=ml networks)
SHIPPED = {
    "tiny-olmoe": ("olmoe", 30, 4, 64, 8, True),
    "deep-olmoe": ("olmoe", 40, 16, 64, 8, True),
    "deep-mixtral": ("mixtral", 40, 32, 8, 2, True),
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
    from specmd.commands.card import routing_stats, wikitext_test_pages

    _, model, tok = shipped
    stats = routing_stats(model, tok, wikitext_test_pages(mirror), max_tokens=8192)
    # balanced, no dead expert, token-to-token locality like the real model of its shape (modelcard docstring)
    assert routing_failures(stats) == [], stats


def test_routing_bounds_name_what_fails():
    ok = {"num_experts": 8, "top_k": 2, "layers": [0, 1, 2], "entropy_ratio": [0.95] * 3, "dead_fraction": [0.0] * 3,
          "temporal_overlap": [0.30, 0.40, 0.42], "random_overlap": 0.25}
    assert routing_failures(ok) == []  # mean 0.373, within 0.06 of Mixtral's 0.376; lowest 0.30 >= 0.25
    low = {**ok, "temporal_overlap": [0.24, 0.42, 0.44]}
    assert routing_failures(low) == ["layer 0: locality 0.240 < 0.25"]
    far = {**ok, "temporal_overlap": [0.45, 0.45, 0.46]}
    assert routing_failures(far) == ["mean locality 0.453 not within 0.06 of Mixtral-8x7B-Instruct's 0.376"]
    olmoe = {**ok, "num_experts": 64, "top_k": 8, "random_overlap": 0.125, "temporal_overlap": [0.19, 0.18, 0.2],
             "entropy_ratio": [0.95, 0.8, 0.9], "dead_fraction": [0.0, 0.0, 1 / 64]}
    assert routing_failures(olmoe) == ["layer 1: usage entropy 0.800 log E < 0.85",
                                       "layer 2: 1.6% of experts never selected",
                                       "layer 1: locality 0.180 <= 1.5 x random (0.1875)"]


def test_reference_statistics_of_the_real_models(mirror):
    from specmd.commands.card import reference_layers, reference_stats

    olmoe, mixtral = reference_stats(mirror, "olmoe"), reference_stats(mirror, "mixtral")
    assert olmoe["tokens"] == mixtral["tokens"] == 5 * 208_896  # five domains, the provenance's token count
    assert olmoe["layers"] == [0, 7, 15] and len(mixtral["co_selection_nmi"]) == 2
    # OLMoE's routing is more skewed than Mixtral's, and its layers share more information
    assert olmoe["skew"][1]["max_share_x_E"] > mixtral["skew"][1]["max_share_x_E"] > 1.0
    assert olmoe["co_selection_nmi"][0] > mixtral["co_selection_nmi"][0] > 0
    assert reference_layers("olmoe", 16) == [0, 7, 15] and reference_layers("mixtral", 32) == [0, 7, 15]
    assert reference_layers("olmoe", 4) == [0, 2, 3]
