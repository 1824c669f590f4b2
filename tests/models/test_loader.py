"""The real-checkpoint path (``from_pretrained``) on a local directory, and the tiny model contract."""

import pytest
import torch

from tests.conftest import FAMILIES, sample_ids, tiny
from specmd.errors import ConfigError
from specmd.models.loader import ModelConfig, load_model


def test_load_local_checkpoint_roundtrip(tmp_path):
    from specmd.models.tokenizer import byte_tokenizer

    model = tiny("mixtral")
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaded, tok = load_model(ModelConfig(name="local", family="mixtral", pretrained=str(tmp_path), dtype="float32"))
    ids = sample_ids(batch=1, seq=12)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert tok("héllo").input_ids == byte_tokenizer()("héllo").input_ids


def test_family_mismatch_is_rejected(tmp_path):
    tiny("mixtral").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="'mixtral' model but model.family='olmoe'"):
        load_model(ModelConfig(name="x", family="olmoe", pretrained=str(tmp_path)))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_are_shaped_like_their_family(family):
    from specmd.models.adapters import adapter_for

    model = tiny(family)
    geom = adapter_for(family).geometry(model)
    moe_ids = geom.layer_ids
    expert_share = geom.expert_bytes * geom.num_experts * geom.num_layers / geom.total_bytes
    assert expert_share > 0.8, expert_share  # experts dominate the bytes
    real = {"olmoe": (64, 8), "mixtral": (8, 2), "qwen2_moe": (60, 4), "qwen3_moe": (128, 8), "phimoe": (16, 2),
            "deepseek_v2": (64, 6), "deepseek_v3": (256, 8), "gpt_oss": (32, 4)}[family]
    assert (geom.num_experts, geom.top_k) == real
    if family.startswith("deepseek"):
        assert moe_ids[0] == 1  # first layer dense, as in the real models


def test_byte_tokenizer_roundtrips():
    from specmd.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    text = "Grüße, 世界! = Title =\n  x"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok) == 259


def test_any_checkpoint_by_path_runs_as_its_own_family(tmp_path, mirror, monkeypatch):
    """``model=hf model.pretrained=DIR``: the family (and E, top-k, layout) from the checkpoint's config.json;
    on a DeepSeek-V3 checkpoint whose routers carry a selection bias, max_rank with M = k keeps every
    selection (routing fidelity 1.0: the family's rule is what the policy ranks by)."""
    import json

    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR
    from specmd.app import execute
    from specmd.models.loader import build_tiny
    from specmd.models.tokenizer import byte_tokenizer

    monkeypatch.setenv("SPECMD_DATA_MIRROR", str(mirror))
    model = build_tiny("deepseek_v3")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(256, generator=g) * 0.5)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    byte_tokenizer().save_pretrained(ckpt)
    ov = ["model=hf", f"model.pretrained={ckpt}", "model.dtype=float32", "routing=max_rank", "routing.M=8",
          "routing.J=0", "eval.tasks=[wikitext]", "eval.limit=1", "eval.max_length=64", "logger=none"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=ov)
    execute(cfg, run_dir=str(tmp_path / "run"), overrides=ov)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["routing"]["fidelity"] == 1.0
    assert res["cache"]["requests"] > 0
    assert res["provenance"]["model"]["family"] == "deepseek_v3"


def test_family_auto_resolves_from_config_json_outside_a_run_too(tmp_path):
    """A ModelConfig made by code (a command, a notebook) with family=auto loads as its checkpoint's family."""
    from specmd.models.tokenizer import byte_tokenizer

    tiny("mixtral").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    cfg = ModelConfig(name="x", family="auto", pretrained=str(tmp_path), dtype="float32")
    model, _ = load_model(cfg)
    assert cfg.family == "mixtral" and model.config.model_type == "mixtral"
    with pytest.raises(ConfigError, match="model.family=auto .* model.pretrained is null"):
        ModelConfig(name="x", family="auto")
