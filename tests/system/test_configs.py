"""Every option of every config group composes and validates against its schema."""

from pathlib import Path

import re

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import ROOT
from specmd import CONF_DIR, shipped
from specmd.engine import GROUPS as FAMILIES
from specmd.app import Run
from specmd.errors import ConfigError

CONF = Path(CONF_DIR)
# the groups config.yaml composes by default (each option of each must validate); the policy families among them
GROUPS = list(shipped.defaults())
NEEDS_QUANT = {"fetch_priority", "drop_priority_cascade"}  # cascades of stored precisions


options = shipped.options


def compose_run(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return Run(compose(config_name="config", overrides=overrides))


EMBEDDED_TRACE = Path(__file__).resolve().parents[1] / "data" / "embedded_trace"


def oracle(group, option) -> bool:
    """Oracles need the future: only a trace replay runs them."""
    from specmd.policies import REGISTRIES

    return group in REGISTRIES and REGISTRIES[group].get(option).needs_future


# options that name no complete setting on their own: what a user adds to them
COMPLETE = {("model", "hf"): ["model.pretrained=specmd:tiny-olmoe"]}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_validates(group, option):
    run = compose_run([f"{group}={option}"] + ([f"replay.trace={EMBEDDED_TRACE}"] if oracle(group, option) else [])
                      + COMPLETE.get((group, option), []))
    if group in FAMILIES:
        assert run.policies[group][0].name == option  # config file named like its registry name
    if group == "model":
        assert run.model.name == option


def test_every_registered_policy_has_a_config():
    from specmd.executor import EXECUTION
    from specmd.policies import REGISTRIES
    from specmd.quant import QUANT

    for group, reg in {**REGISTRIES, "quant": QUANT, "execution": EXECUTION}.items():
        assert reg.names() == options(group)


POLICY_GROUPS = [*FAMILIES, "quant"]


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
    if oracle(group, option):  # replayed on the embedded model's recorded routing instead
        from specmd.replay.driver import run_replay
        from specmd.replay.trace import read_trace

        engine = run_replay(read_trace(EMBEDDED_TRACE), compose_run(overrides + [f"replay.trace={EMBEDDED_TRACE}"]).spec)
        engine.cache.check_invariants()
        s = engine.cache.stats.summary()
        assert s["requests"] > 0 and s["hits"] + s["misses"] == s["requests"]
        return
    if option in NEEDS_QUANT or option in ("hqq", "auto"):
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


@pytest.mark.parametrize("overrides,needle", [
    (["miss=fetch_priority", "quant=none"], r"miss=fetch_priority needs precision\(s\) \['int8', 'int4', 'int2'\].*stores only native"),
    (["miss=fetch", "miss.precision=int3", "quant=hqq"], r"\['int3'\].*native, int8, int4, int2"),
    (["miss=drop_priority_cascade", "quant=hqq", "quant.precisions=[int8]"], r"\['int4', 'int2'\]"),
])
def test_precisions_a_miss_policy_needs_are_checked_before_loading(overrides, needle):
    """quant=none / an explicit quant=hqq list must hold what the miss policy needs (quant=auto, the
    default, stores exactly that)."""
    with pytest.raises(ConfigError, match=needle):
        compose_run(overrides)


def test_auto_quant_stores_what_the_miss_policy_needs():
    assert compose_run([]).quant[1].precisions == []  # miss=fetch: nothing is quantized
    assert compose_run(["miss=fetch_priority"]).quant[1].precisions == ["int8", "int4", "int2"]
    assert compose_run(["miss=fetch", "miss.precision=int4"]).quant[1].precisions == ["int4"]
    assert compose_run(["miss=fetch_priority", "quant=hqq"]).quant[1].precisions == ["int8", "int4", "int2"]


def test_store_rechecks_precisions_when_the_stack_is_built(embedded):
    from specmd.compose import spec_of
    from specmd.hook import install
    from specmd.models.adapters import adapter_for

    with pytest.raises(ConfigError, match="int8.*not stored.*native.*quant=hqq"):
        install(embedded[0], spec_of(miss="fetch_priority", prefetch="none"), adapter_for("olmoe"))
    assert all(type(l.mlp.experts).__name__ != "SpecmdExperts" for l in embedded[0].model.layers)


def test_experts_per_layer_fraction_is_a_share_of_each_layers_experts():
    from specmd.engine import Geometry
    from specmd.engine.geometry import pool_capacities

    g = Geometry(num_layers=4, num_experts=64, top_k=8, expert_bytes=10, total_bytes=10 * 64 * 4)
    assert pool_capacities(g, 0.05, 0.5, "per_layer") == [320] * 4  # Cache-Conditional Experts' N/2
    assert pool_capacities(g, 0.05, 0.5, "global") == [1280]
    assert pool_capacities(g, 0.05, 3, "per_layer") == [30] * 4  # whole numbers stay slot counts
    assert pool_capacities(g, 0.05, 0.35, "per_layer") == [220] * 4  # 22.4 slots: to the nearest, 22
    assert pool_capacities(g, 0.05, 0.0079, "per_layer") == [10] * 4  # 0.51 of a slot: one
    with pytest.raises(ConfigError, match=r"experts_per_layer=0.001 is 0.064 of a layer's 64 experts, which rounds "
                                          r"to 0 slots.*above 0.007812"):
        pool_capacities(g, 0.05, 0.001, "per_layer")  # a cache that holds nothing is an error, not one slot


def test_ranges_that_depend_on_the_model_are_checked_when_its_geometry_is_known():
    from specmd.engine import Geometry
    from specmd.compose import spec_of
    from specmd.engine.engine import Engine
    from specmd.hardware import HardwareConfig

    g = Geometry(num_layers=2, num_experts=8, top_k=2, expert_bytes=10, total_bytes=200)
    for kw, needle in ((dict(routing={"name": "cache_prior", "J": 3}), "routing.J=3 must be in 0..2"),
                       (dict(miss={"name": "drop", "J": 5}), "miss.J=5 must be in 0..2"),
                       (dict(routing={"name": "cumsum", "J": -1}), "routing.J=-1 must be in 0..2"),
                       (dict(hardware=HardwareConfig(experts_per_layer=9)),
                        "hardware.experts_per_layer=9 exceeds the model's 8 experts per layer")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            Engine(g, spec_of(**kw))
    Engine(g, spec_of(routing={"name": "cache_prior", "J": 2}, hardware=HardwareConfig(experts_per_layer=8)))
    assert compose_run(["eval.limit=2.0"]).eval.limit == 2  # a whole float is a document count


def test_real_model_configs_name_their_checkpoints():
    from specmd.models.adapters import families

    for name in families():  # every family has a real-checkpoint config named after it
        run = compose_run([f"model={name}"])
        assert run.model.pretrained and run.model.family == name


@pytest.mark.parametrize("override,needle", [
    ("hardware.capacity=0", "hardware.capacity=0"),
    ("hardware.experts_per_layer=0", "experts_per_layer=0"),
    ("hardware.experts_per_layer=2.5", "experts_per_layer=2.5 must be a whole number of slots >= 1, a fraction"),
    # typed fields: no bool("maybe"), no string iterated as a list (issue 10's accepted-wrongly cases)
    ("stack.enabled=maybe", "stack.enabled='maybe' must be true or false"),
    ("trace.save=notabool", "trace.save='notabool' must be true or false"),
    ("eval.tasks=wikitext", "eval.tasks='wikitext' must be a list (e.g. eval.tasks=[wikitext])"),
    ("eval.token_by_token=yes", "eval.token_by_token='yes' must be true or false"),
    ("eval.limit=1.5", "eval.limit=1.5: a number of documents (a whole number) or a fraction"),
    ("eval.max_length=1", "eval.max_length=1 must be >= 2"),
    ("eval.max_length=-5", "eval.max_length=-5 must be >= 2"),
    ("eval.batch_size=two", "eval.batch_size='two' must be an integer"),
    ("eviction=lfu eviction.history=sometimes", "eviction=lfu: history='sometimes' must be true or false"),
    ("trace.depth=deep", "trace.depth='deep' must be an integer"),
    ("miss.precision=int9", "precision='int9'; valid: native, fp32, bf16"),
    ("miss=fetch_priority miss.precisions=int9:4", "unknown precision(s) ['int9']"),
    ("miss=fetch_priority miss.precisions=int4:8", "a cascade runs from the highest precision down"),
    ("miss=fetch_lowest_bit miss.precisions=int8:8", "a cascade runs from the highest precision down"),
    ("hardware.latency_us=-1", "latency_us=-1"),
    ("prefetch.overfetch=0", "overfetch=0"),
    ("eval.batch_size=0", "eval.batch_size=0"),
    ("model.dtype=int3", "float32"),
    ("+hardware.colour=red", "colour"),
    ("hardware.timing_as=gpt5", "hardware.timing_as='gpt5': no shipped model config; valid choices: mixtral, olmoe"),
    ("stack.measure=prefill", "stack.measure='prefill'; valid choices: all, decode"),
    ("stack.measure=decode eval.tasks=[wikitext]",
     "stack.measure=decode counts decode passes only, and eval.tasks=['wikitext'] run none"),
    ("eviction=least_stale eviction.order=lifo", "order='lifo'; valid: needed_last, left_then_right, layer, insertion"),
    ("eviction=fld eviction.distance=cyclic", "distance='cyclic'; valid: absolute, forward"),
    ("eviction=lfu eviction.counts=hits", "counts='hits'; valid: requests, inserts"),
    ("eviction=score eviction.unit=pass", "unit='pass'; valid: token, call"),
    ("prefetch=score prefetch.basis=layer", "basis='layer'; valid: window, token"),
])
def test_invalid_values_rejected(override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        compose_run(override.split())


def test_measure_decode_accepts_generation_tasks_and_token_by_token():
    assert compose_run(["stack.measure=decode", "eval.tasks=[gsm8k]"]).spec.measure == "decode"
    assert compose_run(["stack.measure=decode", "eval.tasks=[wikitext]", "eval.token_by_token=true"]).spec.measure == "decode"


@pytest.mark.parametrize("model,asset", [("deep_olmoe", "specmd:deep-olmoe"), ("tiny", "specmd:tiny-olmoe"),
                                         ("deep_mixtral", "specmd:deep-mixtral")])
def test_ml_eviction_defaults_to_the_models_own_networks(model, asset):
    run = compose_run([f"model={model}", "eviction=ml"])
    assert run.policies["eviction"][1].weights == asset


def test_code_defaults_are_the_default_profile():
    """One home per default: HardwareConfig() is the profile a run gets by default (config.yaml's hardware
    entry), field for field, so figures timed in code and tests are the ones a default run reports."""
    import dataclasses

    from omegaconf import OmegaConf

    from specmd import CONF_DIR
    from specmd.hardware import HardwareConfig

    defaults = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/config.yaml"))["defaults"]
    (name,) = [d["hardware"] for d in defaults if isinstance(d, dict) and "hardware" in d]
    profile = OmegaConf.to_container(OmegaConf.load(f"{CONF_DIR}/hardware/{name}.yaml"))
    code = dataclasses.asdict(HardwareConfig())
    assert set(code) == set(profile) and code == dataclasses.asdict(HardwareConfig(**profile))  # (null mapping: {})
    assert code["mem_bandwidth_gbps"] == 1935.0  # the A100 80GB PCIe datasheet's, not the 40GB's 1,555
