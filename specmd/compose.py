"""The composition root's helpers: configuration -> the engine's pure data.

The engine (:mod:`specmd.engine`) imports nothing above it: it receives a :class:`~specmd.engine.StackSpec`
whose policy classes were looked up here, in the registries, and the timing geometry that
``hardware.timing_as`` names, read here from the shipped model configs. ``specmd.app`` (a run), the
drivers' callers (``specmd.train_eviction``, ``specmd.calibrate``, benchmarks) and tests build their specs
with these two functions.
"""

from __future__ import annotations

from typing import Any, Optional

from .engine import GROUPS, StackSpec
from .errors import ConfigError

DEFAULTS = {"routing": "standard", "miss": "fetch", "eviction": "lru", "prefetch": "topk"}


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


def stack_spec(groups: dict, hardware: Any, quant: Optional[dict] = None, measure: str = "all") -> StackSpec:
    """From config mappings: ``groups[family] = {"name": ..., params}`` (validated by the registries)."""
    from .policies import REGISTRIES
    from .quant import QUANT

    parts = {g: REGISTRIES[g].params(groups.get(g) or {"name": DEFAULTS[g]}) for g in GROUPS}
    q = QUANT.params(quant) if quant is not None else None
    return StackSpec(hardware=hardware, quant=q, measure=measure, timing=timing_of(hardware), **parts)


def spec_of(hardware: Any = None, quant: Any = None, measure: str = "all", **groups) -> StackSpec:
    """For code and tests: ``spec_of(eviction="lfu", miss={"name": "drop", "J": 1})``; a family is a name
    or a config mapping, missing ones take the defaults; ``hardware`` a HardwareConfig (default: the
    default profile's); ``quant`` a mapping or None."""
    from .hardware import HardwareConfig

    groups = {g: ({"name": v} if isinstance(v, str) else v) for g, v in groups.items()}
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise TypeError(f"unknown policy families {sorted(unknown)}; valid: {GROUPS}")
    return stack_spec(groups, hardware or HardwareConfig(), quant, measure)
