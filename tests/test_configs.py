"""Every option of every config group composes and validates against its schema."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conftest import ROOT
from specmd.app import Run
from specmd.errors import ConfigError

CONF = ROOT / "conf"
GROUPS = ["model", "routing", "miss", "eviction", "prefetch", "quant", "hardware", "logger"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_run(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return Run(compose(config_name="config", overrides=overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_validates(group, option):
    run = compose_run([f"{group}={option}"])
    if group in ("routing", "miss", "eviction", "prefetch"):
        assert run.policies[group][0].name == option  # config file named like its registry name
    if group == "model":
        assert run.model.name == option


def test_every_registered_policy_has_a_config():
    from specmd.policies.eviction import EVICTION
    from specmd.policies.miss import MISS
    from specmd.policies.prefetch import PREFETCH
    from specmd.policies.routing import ROUTING

    from specmd.quant import QUANT

    for group, reg in (("routing", ROUTING), ("miss", MISS), ("eviction", EVICTION), ("prefetch", PREFETCH),
                       ("quant", QUANT)):
        assert reg.names() == options(group)


POLICY_GROUPS = ["routing", "miss", "eviction", "prefetch", "quant"]
NEEDS_QUANT = {"fetch_priority", "drop_priority_cascade"}  # cascades of stored precisions


@pytest.fixture(scope="module")
def embedded():
    from specmd.models.loader import load_model

    run = compose_run([])
    return load_model(run.model)


@pytest.mark.parametrize("group,option", [(g, o) for g in POLICY_GROUPS for o in options(g)])
def test_every_option_runs_on_the_embedded_model(group, option, embedded):
    """Each option, installed on the shipped model at 5% capacity, serves a prefill and decode steps with
    the cache invariants intact (the same stacks `python -m specmd -m <group>=...` builds)."""
    import torch

    model, tok = embedded
    overrides = [f"{group}={option}", "hardware.capacity=0.05"]
    if option in NEEDS_QUANT:
        overrides.append("quant=hqq")
    if option in NEEDS_QUANT or option == "hqq":
        overrides.append("quant.optimize=false")  # HQQ's refinement costs ~30 s on 2 cores; the path is the same
    run = compose_run(overrides)
    ids = tok("The tower is 324 metres tall, about the same height as", return_tensors="pt")["input_ids"]
    stack = run.build_stack(model)
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False)
    finally:
        stack.remove()
    assert out.shape[1] == ids.shape[1] + 3
    stack.cache.check_invariants()
    s = stack.cache.stats.summary()
    assert s["requests"] > 0 and s["hits"] + s["misses"] == s["requests"]
    assert stack.cache.stats.timing()["decode_passes"] == 2


def test_cascade_without_stored_precisions_is_a_clear_error(embedded):
    run = compose_run(["miss=fetch_priority"])
    with pytest.raises(ConfigError, match="int8.*not stored.*native.*quant=hqq"):
        run.build_stack(embedded[0])
    assert all(type(l.mlp.experts).__name__ != "SpecmdExperts" for l in embedded[0].model.layers)


def test_real_model_configs_name_their_checkpoints():
    for name in ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "phimoe", "deepseek_v2", "deepseek_v3", "gpt_oss"):
        run = compose_run([f"model={name}"])
        assert run.model.pretrained and run.model.family == name


@pytest.mark.parametrize("override,needle", [
    ("hardware.capacity=0", "hardware.capacity=0"),
    ("hardware.experts_per_layer=0", "experts_per_layer=0"),
    ("hardware.latency_us=-1", "latency_us=-1"),
    ("prefetch.overfetch=0", "overfetch=0"),
    ("eval.batch_size=0", "eval.batch_size=0"),
    ("model.dtype=int3", "float32"),
    ("+hardware.colour=red", "colour"),
])
def test_invalid_values_rejected(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        compose_run([override])
