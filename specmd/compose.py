"""The composition root's helpers: configuration -> the engine's pure data.

The engine (:mod:`specmd.engine`) imports nothing above it: it receives a :class:`~specmd.engine.StackSpec`
whose policy classes were looked up here, in the registries, and the timing geometry that
``hardware.timing_as`` names, read here from the shipped model configs. :func:`build_spec` is the one
builder of a spec: ``specmd.app`` (a run, from its validated config), :func:`stack_spec` (config mappings:
the drivers' callers ``specmd.commands.train_eviction``, ``specmd.commands.calibrate``, benchmarks) and :func:`spec_of` (code
and tests) all end there. A family left out takes its default from ``specmd/conf/config.yaml`` (as the
hardware does, :func:`specmd.hardware.default_profile`): the defaults have one home.
"""

from __future__ import annotations

from typing import Any, Optional

from . import shipped
from .engine import GROUPS, StackSpec
from .errors import ConfigError

# each family's default policy and the measured passes: what a run composes when the user names none
_SHIPPED = shipped.defaults()  # (config.yaml read once per process, not once per family)
DEFAULTS = {g: _SHIPPED[g] for g in GROUPS}
MEASURE = shipped.load("config")["stack"]["measure"]


def timing_of(hardware: Any) -> Optional[tuple]:
    """``(name, Geometry)`` of the real model named by ``hardware.timing_as`` (its shipped config; no
    weights), or None: the running model's own sizes and compute."""
    name = getattr(hardware, "timing_as", None)
    if not name:
        return None
    from .models.loader import shipped_geometry

    try:
        return name, shipped_geometry(name)
    except ConfigError as e:
        raise ConfigError(f"hardware.timing_as={e}") from None


def build_spec(policies: dict, hardware: Any, quant: Optional[tuple] = None, measure: str = MEASURE,
               execution: Optional[tuple] = None) -> StackSpec:
    """The one builder of a :class:`~specmd.engine.StackSpec`: ``policies[family] = (class, validated
    params)`` for every family, ``quant`` and ``execution`` (class, params) or None, and the timing geometry
    ``hardware.timing_as`` names."""
    return StackSpec(hardware=hardware, quant=quant, measure=measure, timing=timing_of(hardware),
                     execution=execution, **{g: policies[g] for g in GROUPS})


def stack_spec(groups: dict, hardware: Any, quant: Optional[dict] = None, measure: str = MEASURE) -> StackSpec:
    """From config mappings: ``groups[family] = {"name": ..., params}`` (validated by the registries)."""
    from .policies import REGISTRIES
    from .quant import QUANT

    parts = {g: REGISTRIES[g].params(groups.get(g) or {"name": DEFAULTS[g]}) for g in GROUPS}
    q = QUANT.params(quant) if quant is not None else None
    return build_spec(parts, hardware, q, measure)


def spec_of(hardware: Any = None, quant: Any = None, measure: str = MEASURE, **groups) -> StackSpec:
    """For code and tests: ``spec_of(eviction="lfu", miss={"name": "drop", "J": 1})``; a family is a name
    or a config mapping, missing ones take the defaults; ``hardware`` a HardwareConfig (default: the
    default profile's); ``quant`` a mapping or None."""
    from .hardware import HardwareConfig

    groups = {g: ({"name": v} if isinstance(v, str) else v) for g, v in groups.items()}
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise TypeError(f"unknown policy families {sorted(unknown)}; valid: {GROUPS}")
    return stack_spec(groups, hardware or HardwareConfig(), quant, measure)
