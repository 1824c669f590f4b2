"""The real-checkpoint path (``from_pretrained``) on a local directory, and the tiny model contract."""

import pytest
import torch

from conftest import FAMILIES, sample_ids, tiny
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
