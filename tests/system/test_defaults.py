"""One home per list and default: every registered class's ``Params`` defaults equal its config file's values
(``specmd/conf/<family>/<name>.yaml``), the stack's defaults are ``conf/config.yaml``'s, and the policy
families are the engine's ``GROUPS`` everywhere they are listed."""

from dataclasses import fields

import pytest

from specmd import shipped
from specmd.engine import GROUPS
from specmd.executor import EXECUTION
from specmd.policies import REGISTRIES
from specmd.quant import QUANT
from specmd.registry import build_params

FAMILIES = {**REGISTRIES, "quant": QUANT, "execution": EXECUTION}  # every registry with a config group
# Params fields a class fills itself, never read from its config: quant=auto's precisions are the miss policy's
# (QuantMethod.resolve), so its yaml leaves them out
RESOLVED = {("quant", "auto"): {"precisions"}}


def interpolated(value) -> bool:
    """``${model.pretrained}``: a value taken from another section when Hydra composes, not a default."""
    return isinstance(value, str) and "${" in value


def mismatches(cls, yaml: dict, resolved: frozenset = frozenset()) -> list:
    """What differs between ``cls.Params``'s defaults and its config file's fields (both ways; a field named
    ``lambda_`` is the config's ``lambda``, as :func:`specmd.registry.build_params` reads it)."""
    given = {k: v for k, v in yaml.items() if k != "name"}
    if cls.Params is None:
        return [f"{k}: in the yaml, but {cls.__name__} has no Params" for k in given]
    default = cls.Params()
    attr = {f.name.rstrip("_"): f.name for f in fields(cls.Params)}  # config key -> dataclass field
    out = [f"{k}: in the yaml, not a Params field" for k in sorted(set(given) - set(attr))]
    out += [f"{k}: a Params field the yaml does not show (default {getattr(default, attr[k])!r})"
            for k in sorted(set(attr) - set(given) - resolved)]
    for k in sorted(set(attr) & set(given)):
        if interpolated(given[k]):
            continue
        value = getattr(build_params(cls.Params, {k: given[k]}, cls.name), attr[k])  # as validated (80 -> 80.0)
        if value != getattr(default, attr[k]):
            out.append(f"{k}: Params says {getattr(default, attr[k])!r}, the yaml {given[k]!r}")
    return out


@pytest.mark.parametrize("family,name", [(f, n) for f, reg in FAMILIES.items() for n in reg.names()])
def test_every_params_default_equals_its_yaml(family, name):
    cls = FAMILIES[family].get(name)
    resolved = frozenset(RESOLVED.get((family, name), ()))
    assert mismatches(cls, shipped.option(family, name), resolved) == [], f"{family}={name}"


def test_the_check_itself_sees_a_changed_default():
    cls = REGISTRIES["routing"].get("prune")
    assert mismatches(cls, {"name": "prune", "h": cls.Params().h + 1}) != []
    assert mismatches(cls, {"name": "prune"}) != []  # a field the yaml leaves out


def test_stack_defaults_are_config_yamls():
    from specmd.compose import spec_of
    from specmd.hardware import HardwareConfig

    chosen = shipped.defaults()
    spec = spec_of()
    assert spec.names() == {g: chosen[g] for g in GROUPS}
    assert spec.measure == shipped.load("config")["stack"]["measure"]
    assert HardwareConfig().name == shipped.option("hardware", chosen["hardware"])["name"]


def test_the_policy_families_are_the_engines_groups():
    from specmd.engine import StackSpec

    assert tuple(REGISTRIES) == GROUPS
    assert set(GROUPS) <= set(shipped.defaults())  # each family a config group with a default option
    assert all(REGISTRIES[g].family == g for g in GROUPS)
    assert all(g in {f.name for f in fields(StackSpec)} for g in GROUPS)


def test_replay_defaults_are_config_yamls():
    """The ``replay`` section: every ReplayConfig field shown in conf/config.yaml with its default."""
    from specmd.replay.config import ReplayConfig

    yaml = shipped.load("config")["replay"]
    assert {f.name for f in fields(ReplayConfig)} == set(yaml)
    default = ReplayConfig()
    assert {k: getattr(default, k) for k in yaml} == yaml


def hardware_profiles() -> list:
    from specmd import CONF_DIR
    from pathlib import Path

    return sorted(p.stem for p in (Path(CONF_DIR) / "hardware").glob("*.yaml"))


@pytest.mark.parametrize("profile", hardware_profiles())
def test_every_hardware_field_is_in_every_shipped_profile(profile):
    """A documented setting in the schema of every profile: ``hardware.host_overlap=true`` was refused ("Key not
    in struct") because no shipped profile had the key, although docs/usage.md lists it; the keys are derived
    from :class:`HardwareConfig`, not listed by hand."""
    from specmd.hardware import HardwareConfig

    keys = {f.name for f in fields(HardwareConfig)}
    yaml = shipped.option("hardware", profile)
    assert sorted(keys - set(yaml)) == [] and sorted(set(yaml) - keys) == []


def test_every_hardware_field_is_documented():
    from pathlib import Path

    from specmd.hardware import HardwareConfig

    usage = (Path(__file__).parents[2] / "docs" / "usage.md").read_text()
    assert [f.name for f in fields(HardwareConfig) if f"`{f.name}`" not in usage] == []


def test_every_hardware_field_can_be_overridden_without_a_plus(tmp_path):
    """What a user types from the docs composes on every shipped profile (one compose per profile)."""
    from hydra import compose, initialize_config_dir

    from specmd import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for profile in hardware_profiles():
            cfg = compose("config", [f"hardware={profile}", "hardware.host_overlap=true",
                                     "hardware.small_copy_gbps=9.5", "hardware.policy_overhead_us={prefetch/score: 1}"])
            assert cfg.hardware.host_overlap is True and cfg.hardware.small_copy_gbps == 9.5
