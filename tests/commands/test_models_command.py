"""``specmd models``: the table of every MoE family of the installed transformers -- runs (record or derived)
or refused, why -- agrees with what loading does, and names the real model, size and selection rule."""

import json

from specmd.commands.models import main, rows, table
from specmd.models.adapters import ADAPTERS, adapter_for, derived_families
from specmd.models.derive import derive, moe_families


def test_the_table_is_every_moe_family_and_says_what_loading_does(capsys):
    rs = rows()
    by = {r["family"]: r for r in rs}
    assert set(by) == set(moe_families()) | set(ADAPTERS)
    for family, r in by.items():
        runs_as = derive(family).runs_as  # (a wrapper whose checkpoints load its text model)
        assert r["runs"] == (family in ADAPTERS or family in derived_families() or bool(runs_as and r["runs"])), family
        assert r["through"] == ("record" if family in ADAPTERS else f"as {runs_as}" if runs_as and r["runs"]
                                else "derived" if r["runs"] else None)
        if runs_as:
            assert r["runs"] == by[runs_as]["runs"]
        if r["runs"]:
            adapter_for(family)  # what the table says runs, loads
            assert r["selection"].startswith(adapter_for(family).score)
            assert r["timing_as"] == (r["experts"] is not None)  # sizes known: timing_as=<family> works
        else:
            assert r["refused_because"].startswith("its ") and not r["timing_as"]
    # the 2026 models of issue 55, at their real sizes (transformers' config class defaults)
    assert (by["glm4_moe"]["real_model"], by["glm4_moe"]["experts"], by["glm4_moe"]["top_k"]) == ("zai-org/GLM-4.5",
                                                                                               128, 8)
    assert by["qwen3_next"]["experts"] == 512 and by["qwen3_next"]["top_k"] == 10
    assert "selection bias" in by["deepseek_v3"]["selection"] and "group-limited (top2)" in by["deepseek_v3"]["selection"]
    assert "selection bias" not in by["mixtral"]["selection"]
    # a hub layout where transformers' conversion mapping declares one (GLM-4.5's, derived, too); GPT-OSS: none
    assert by["mixtral"]["random_checkpoint"] and by["glm4_moe"]["random_checkpoint"]
    assert not by["gpt_oss"]["random_checkpoint"]
    assert "returns 4 value(s)" in by["zaya"]["refused_because"]
    assert by["deepseek_v4"]["selection"].startswith("sqrtsoftplus, selection bias, hash-routed layers")
    assert by["longcat_flash"]["selection"].endswith("identity experts=zero_expert_num")  # LongCat-Flash's 256
    assert (by["longcat_flash"]["experts"], by["longcat_flash"]["top_k"]) == (512, 12)  # (its experts with weights)
    assert by["llama4"]["through"] == "as llama4_text" and (by["llama4_text"]["experts"], by["llama4_text"]["top_k"]) \
        == (16, 1)  # Llama-4 Scout: its block adopted into the contract
    assert by["jamba"]["runs"] and by["jamba"]["through"] == "derived"  # its block is layer.feed_forward
    assert by["qwen3_5_moe"]["through"] == "as qwen3_5_moe_text"  # Qwen3.5-MoE's hub checkpoints name the wrapper
    assert by["kimi_k25"]["runs"] and by["kimi_k25"]["experts"] == 256  # Kimi-K2.5: its text decoder (V3 defaults)
    text = table(rs)
    assert text.splitlines()[0] == f"{sum(r['runs'] for r in rs)} of {len(rs)} MoE families of the installed transformers run"
    assert main(["--json"]) == 0 and json.loads(capsys.readouterr().out) == rs


def test_timing_as_takes_any_family_that_runs_at_its_real_size():
    from specmd.compose import timing_of
    from specmd.errors import ConfigError
    from specmd.hardware import HardwareConfig

    name, geom = timing_of(HardwareConfig(timing_as="glm4_moe"))  # GLM-4.5-Air: 46 layers, the first dense
    assert (geom.num_layers, geom.num_experts, geom.top_k, geom.layer_ids[0]) == (45, 128, 8, 1)
    import pytest

    with pytest.raises(ConfigError, match="hardware.timing_as='zaya'.*a family that runs"):
        timing_of(HardwareConfig(timing_as="zaya"))
    name, geom = timing_of(HardwareConfig(timing_as="llama4"))  # Llama-4 Scout: 48 layers of 16 experts, top-1
    assert (name, geom.num_layers, geom.num_experts, geom.top_k) == ("llama4", 48, 16, 1)
    with pytest.raises(ConfigError, match="hardware.timing_as='deepseek_v2': the defaults of transformers' "
                                          "deepseek_v2 config class do not build"):
        timing_of(HardwareConfig(timing_as="deepseek_v2"))  # (it runs; its class defaults build no model)
