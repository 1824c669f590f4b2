"""A model family is one record (:class:`specmd.models.adapters.Adapter`): each record is complete (its hub
layout round-trips writer -> loader -> disk tier, its experts layout is its module's), and no second table of
families, hub names or experts-module flags lives outside ``specmd/models/adapters.py``."""

import ast

import pytest
import torch

from tests.conftest import FAMILIES, ROOT, tiny
from specmd.models.adapters import ADAPTERS, HubLayout, adapter_for, derived_families


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_layout_is_the_family_module(family):
    """The kernels read the adapter's :class:`ExpertsLayout`, never the module: it must say what
    transformers' ``use_experts_implementation`` set on the family's experts class."""
    adapter = adapter_for(family)
    model = tiny(family)
    mod = adapter.experts(model, adapter.moe_layers(model)[0])
    layout = adapter.experts_layout
    assert (layout.gated, layout.transposed, layout.bias, layout.post_norm) == (
        getattr(mod, "has_gate", True), getattr(mod, "is_transposed", False), getattr(mod, "has_bias", False),
        getattr(mod, "has_post_expert_norm", False))
    E = adapter.num_experts(model.config)
    per_expert = {n for n, p in mod.named_parameters(recurse=False) if p.shape[0] == E}
    assert per_expert == {n for n in layout.names if n}


@pytest.mark.parametrize("family", FAMILIES + [f for f in derived_families() if adapter_for(f).hub_layout()])
def test_hub_layout_round_trips_writer_loader_and_disk_tier(tmp_path, family):
    """A random checkpoint in the family's hub layout -- what transformers' conversion mapping declares for it
    (:meth:`Adapter.hub_layout`; transformers' own layout for a family without one) -- has the names
    transformers' ``save_pretrained`` writes (its conversion back to the hub's), loads through
    ``from_pretrained`` without a missing or unexpected key, and is what specmd's own readers -- the dense
    loader (experts on meta) and the disk tier (experts per expert) -- read back, bit for bit: on every family
    with a record, and every derived one whose hub layout transformers declares."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from specmd.executor.kernel import expert_tensors
    from specmd.executor.tiers import DiskTier
    from specmd.models.loader import ModelConfig, load_dense, tiny_config
    from specmd.models.random_checkpoint import write_random_checkpoint

    adapter = adapter_for(family)
    path = write_random_checkpoint(tiny_config(family).to_dict(), tmp_path / family, dtype="float32",
                                   layout="hub" if adapter.hub_layout() else "transformers")
    ref, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    tiny(family).save_pretrained(tmp_path / "saved")  # a model built here: not loaded, so no names remembered
    saved = set()
    for f in (tmp_path / "saved").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            saved |= set(st.keys())
    assert set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) == saved

    dense = load_dense(str(path), ModelConfig(family=family, pretrained=str(path)))
    want = ref.state_dict()
    got = {n: t for n, t in dense.state_dict().items() if not t.is_meta}
    assert got and all(torch.equal(t, want[n]) for n, t in got.items())

    ids, E = adapter.moe_layers(ref), adapter.num_experts(ref.config)
    fused = [expert_tensors(adapter.experts(ref, i), E) for i in ids]
    shapes = {n: tuple(t.shape[1:]) for n, t in fused[0].items()}
    tier = DiskTier(str(path), ids, shapes, torch.float32, E, adapter.hub_layout())
    try:
        for layer, tensors in enumerate(fused):
            for e in range(E):
                dst = {n: torch.empty(s) for n, s in shapes.items()}
                tier.copy_into(layer, e, dst)
                assert all(torch.equal(dst[n], t[e]) for n, t in tensors.items()), (layer, e)
    finally:
        tier.close()


# ---- no second table ---------------------------------------------------------------------------------------
# Sources that still keep family knowledge of their own, each to be folded into the adapters (issue 37):
# calibrate.py probes the experts module; modelcard.py keys the real models' routing statistics by family.
PENDING: set = set()  # (none left)
PROBES = {"has_gate", "is_transposed", "has_bias", "has_post_expert_norm"}  # the experts-module flags


def _hub_names() -> set[str]:
    """Every hub name an adapter declares that transformers does not use itself."""
    default = HubLayout()
    out = set()
    for a in ADAPTERS.values():
        hub = a.hub_layout()
        if hub is not None and hub != default:
            out |= {hub.block} if hub.block != default.block else set()
            out |= {f"{getattr(hub, p)}.weight" for p in ("gate", "up", "down") if getattr(hub, p) != getattr(default, p)}
    return out


def test_family_knowledge_lives_only_in_the_adapters():
    """Outside ``models/adapters.py`` no source names several families in one literal (a family table), holds a
    hub checkpoint name, or probes an experts module's layout flags: each reads the adapter."""
    families, hub = set(ADAPTERS), _hub_names()
    found = []
    for path in sorted((ROOT / "specmd").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in ("specmd/models/adapters.py", "specmd/models/family.py", "specmd/models/derive.py",
                   "specmd/models/hub.py", "specmd/models/tiny.py") or rel in PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in families}
                if len(named) > 1:
                    found.append(f"{rel}:{node.lineno}: a table of families {sorted(named)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in PROBES:
                    found.append(f"{rel}:{node.lineno}: probes the experts module ({node.value!r})")
                if any(h in node.value for h in hub):
                    found.append(f"{rel}:{node.lineno}: a hub checkpoint name ({node.value!r})")
    assert not found, "\n".join(found)


def test_hub_layouts_are_what_transformers_declares():
    """How hub checkpoints name their tensors is read from transformers' conversion mapping, not typed again:
    the golden layouts of the records (the ones specmd typed before issue 55), and a derived family's."""
    from specmd.models.hub import declared_hub

    assert adapter_for("olmoe").hub_layout() == HubLayout()
    assert adapter_for("mixtral").hub_layout() == HubLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2")
    assert adapter_for("phimoe").hub_layout() == HubLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2",
                                                           router="router")
    assert adapter_for("gpt_oss").hub_layout() is None  # MXFP4 blocks: transformers declares no conversion
    assert adapter_for("minimax_m2").hub_layout() == HubLayout(
        block="block_sparse_moe", gate="w1", up="w3", down="w2",
        renames=((".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias"),))
    hub = adapter_for("ernie4_5_moe").hub_layout()
    assert hub.from_hub("model.layers.1.mlp.moe_statics.e_score_correction_bias") == \
        "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"
    assert hub.to_hub("model.layers.1.mlp.gate.moe_statics.e_score_correction_bias") == \
        "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    assert declared_hub([]) is None  # nothing declared: not mapped
