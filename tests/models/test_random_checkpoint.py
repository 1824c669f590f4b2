"""Random-weight checkpoints (specmd.models.random_checkpoint): tiny round trips through from_pretrained."""

import json

import pytest
import torch
from safetensors import safe_open

from specmd.models.loader import tiny_config
from specmd.models.adapters import adapter_for
from specmd.models.random_checkpoint import MARKER, write_random_checkpoint

SHARD = 300_000  # bytes: a tiny model spreads over several shards


def _file_tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), "pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == fname
                tensors[key] = f.get_tensor(key)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def _load(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing / unexpected / mismatched keys
    return model


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_hub_layout_round_trip(tmp_path, family):
    out = tmp_path / family
    path = write_random_checkpoint(tiny_config(family).to_dict(), out, shard_bytes=SHARD, layout="hub")
    assert path == out and (out / MARKER).is_file() and (out / "config.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not list(tmp_path.glob(".*partial*"))
    files, index = _file_tensors(out)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in files)  # per expert on the hub

    state = _load(out).state_dict()
    n_layers, n_exp = tiny_config(family).num_hidden_layers, tiny_config(family).num_experts
    for layer in range(n_layers):
        pre = f"model.layers.{layer}.mlp"
        gate_up, down = state[f"{pre}.experts.gate_up_proj"], state[f"{pre}.experts.down_proj"]
        assert gate_up.shape[0] == down.shape[0] == n_exp
        for e in range(n_exp):
            fused = torch.cat([files[f"{pre}.experts.{e}.gate_proj.weight"], files[f"{pre}.experts.{e}.up_proj.weight"]])
            assert torch.equal(gate_up[e], fused)
            assert torch.equal(down[e], files[f"{pre}.experts.{e}.down_proj.weight"])
    norm, bias = "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(files[norm], torch.ones_like(files[norm]))
    if family == "qwen2_moe":
        assert torch.equal(files[bias], torch.zeros_like(files[bias]))
    assert 0.015 < files["model.embed_tokens.weight"].float().std() < 0.025

    # a second call finds the checkpoint complete and writes nothing
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert write_random_checkpoint(tiny_config(family).to_dict(), out, shard_bytes=SHARD, layout="hub") == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_layouts_and_sharding_give_the_same_model(tmp_path):
    cfg = tiny_config("olmoe").to_dict()
    hub = _load(write_random_checkpoint(cfg, tmp_path / "hub", shard_bytes=SHARD, layout="hub")).state_dict()
    fused = _load(write_random_checkpoint(cfg, tmp_path / "tf", shard_bytes=10 ** 9, layout="transformers"))
    files, index = _file_tensors(tmp_path / "tf")
    assert len(set(index["weight_map"].values())) == 1 and "model.layers.0.mlp.experts.gate_up_proj" in files
    for key, value in fused.state_dict().items():
        assert torch.equal(hub[key], value), key
    # another seed: other values, and the old checkpoint is replaced
    write_random_checkpoint(cfg, tmp_path / "hub", shard_bytes=SHARD, layout="hub", seed=1)
    assert json.loads((tmp_path / "hub" / MARKER).read_text())["spec"]["seed"] == 1
    other, _ = _file_tensors(tmp_path / "hub")
    assert not torch.equal(other["model.embed_tokens.weight"], hub["model.embed_tokens.weight"])


def test_unsupported_family_and_layout_are_rejected(tmp_path):
    assert adapter_for("gpt_oss").hub_layout() is None
    with pytest.raises(ValueError, match="'gpt_oss'.*hub layouts: deepseek_v2, deepseek_v3, mixtral, olmoe"):
        write_random_checkpoint(tiny_config("gpt_oss").to_dict(), tmp_path / "g", layout="hub")
    with pytest.raises(ValueError, match="layout='fused'; valid choices: hub, transformers"):
        write_random_checkpoint(tiny_config("olmoe").to_dict(), tmp_path / "o", layout="fused")
    with pytest.raises(ValueError, match="no shipped model config"):
        write_random_checkpoint("no_such_model", tmp_path / "n")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not a random checkpoint"):
        write_random_checkpoint(tiny_config("olmoe").to_dict(), foreign)
    assert not list(tmp_path.glob("*/*.safetensors"))


def test_a_hash_routed_models_table_gets_distinct_experts_per_token(tmp_path):
    """DeepSeek-V4's hash layers route a token to ``tid2eid[token]``: written as zeros (transformers' init), every
    token would go k times to expert 0. The writer gives each row k distinct experts of E, seeded."""
    from specmd.models.tiny import tiny_overrides
    from specmd.models.family import build_config

    fields = dict(build_config("deepseek_v4", tiny_overrides("deepseek_v4")).to_dict(), model_type="deepseek_v4")
    path = write_random_checkpoint(fields, tmp_path / "v4", dtype="float32", layout="transformers")
    tables = {n: t for n, t in _file_tensors(path)[0].items() if n.endswith("tid2eid")}
    assert tables  # (its first layers are hash-routed)
    E = fields["n_routed_experts"]
    for t in tables.values():
        assert t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < E
        assert all(len(set(row)) == t.shape[1] for row in t.tolist())
