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

    for group, reg in (("routing", ROUTING), ("miss", MISS), ("eviction", EVICTION), ("prefetch", PREFETCH)):
        assert reg.names() == options(group)


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
