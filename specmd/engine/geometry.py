"""What the engine knows about a model: MoE-layer count, experts, bytes and the roofline's parameter counts.

A live run reads it off the model (``Adapter.geometry``); a replay reads it from the trace's metadata, so
neither the engine nor a policy ever needs the model itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class Geometry:
    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    expert_bytes: int  # one routed expert at the storage dtype
    total_bytes: int  # the whole model at its storage dtype
    hidden_size: int = 0
    # Roofline inputs (params counted in elements; bytes = params * dtype_bytes):
    dtype_bytes: int = 2
    dense_params: list = field(default_factory=list)  # non-routed params run before MoE layer l (per ordinal)
    attn_layers: list = field(default_factory=list)  # decoder layers covered by segment l (attention count)
    tail_params: int = 0  # params after the last MoE layer (final norm, lm head, trailing dense layers)
    tail_attn_layers: int = 0
    expert_params: int = 0
    layer_ids: list = field(default_factory=list)  # model layer index of each MoE ordinal
    # identity ("zero-computation") experts: router columns num_experts .. num_experts + identity_experts - 1
    # whose expert returns its input (LongCat-Flash's 256 beside its 512): no weights, nothing to cache or fetch
    identity_experts: int = 0
    # the KV cache per sequence (:meth:`specmd.engine.memory.KvLayout.to_dict`; read off the model's config by
    # specmd.models.kv): what hardware.memory_gb takes from the experts' memory. {}: not known (an old trace)
    kv: dict = field(default_factory=dict)

    def __post_init__(self):
        n = self.num_layers
        if not self.dense_params:
            self.dense_params = [0] * n
        if not self.attn_layers:
            self.attn_layers = [0] * n
        if not self.layer_ids:
            self.layer_ids = list(range(n))

    @property
    def router_width(self) -> int:
        """The router's columns (logits [T, router_width]): the experts, then the identity experts."""
        return self.num_experts + self.identity_experts

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Geometry":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _regroup(values: list, n: int) -> list[float]:
    """``values`` (one per source layer) summed into ``n`` consecutive groups of equal fractional width
    (len(values) / n source layers each; a source layer split between two groups counts pro rata)."""
    m = len(values)
    cum = [0.0]
    for v in values:
        cum.append(cum[-1] + v)

    def at(x: float) -> float:  # cumulative sum at fractional position x in [0, m]
        i = min(int(x), m - 1)
        return cum[i] + (x - i) * values[i]

    return [at((l + 1) * m / n) - at(l * m / n) for l in range(n)]


def timed_as(routing: Geometry, timing: Geometry) -> tuple[Geometry, float, float]:
    """The geometry of ``routing``'s layers and experts with the sizes and compute of ``timing`` (a real
    model), for running a small model's routing on a real model's clock (``hardware.timing_as``).

    Mapping when the counts differ (L layers, E experts, top-k; r = routing, t = timing):
    * each routing MoE layer stands for L_t / L_r timing layers: its dense parameters and attention layers
      are those of its share of the timing model's layers (consecutive, split pro rata);
    * each routing expert stands for (L_t·E_t) / (L_r·E_r) timing experts in bytes (so the whole model's
      expert bytes, and what a capacity fraction holds, are the timing model's) and for
      (L_t·k_t) / (L_r·k_r) timing experts in compute (so a token's expert FLOPs are the timing model's);
    * the LM head and trailing layers, hidden size, dtype, total bytes and KV cache are the timing model's.
    Expert *bytes read* per token then scale by (k_r/E_r) / (k_t/E_t): exact when the two models select
    the same fraction of their experts (the embedded model as OLMoE), half the real figure for the embedded
    model as Mixtral (memory-bound decode compute is then understated; transfers and capacity are exact).
    Returns (geometry, bytes factor, params factor): factors on one routing expert's timing-model size."""
    f_bytes = (timing.num_layers * timing.num_experts) / (routing.num_layers * routing.num_experts)
    f_compute = (timing.num_layers * timing.top_k) / (routing.num_layers * routing.top_k)
    geom = Geometry(
        num_layers=routing.num_layers, num_experts=routing.num_experts, top_k=routing.top_k,
        expert_bytes=round(timing.expert_bytes * f_bytes), total_bytes=timing.total_bytes,
        hidden_size=timing.hidden_size, dtype_bytes=timing.dtype_bytes,
        dense_params=_regroup(timing.dense_params, routing.num_layers),
        attn_layers=_regroup(timing.attn_layers, routing.num_layers),
        tail_params=timing.tail_params, tail_attn_layers=timing.tail_attn_layers,
        expert_params=timing.expert_params * f_compute, layer_ids=list(routing.layer_ids),
        identity_experts=routing.identity_experts, kv=dict(timing.kv),
    )
    return geom, f_bytes, f_compute


def slots_per_layer(experts_per_layer: float, num_experts: int) -> int:
    """``hardware.experts_per_layer`` in slots: a whole number >= 1 as it is, a fraction in (0, 1) of the
    layer's experts rounded to the *nearest* slot (Python's ``round``: halves to even), 0.35 x 8 -> 3.
    Cache-Conditional Experts size their cache as a fraction of a layer's experts ("N/2") and report the
    slots it gives; truncation would shrink every fractional cache by up to one slot (0.35 x 8 -> 2, 25%
    less here), rounding up would grow it. A fraction that rounds to 0 slots holds nothing: an error naming
    the smallest fraction that gives one slot."""
    if experts_per_layer >= 1:
        return int(experts_per_layer)
    slots = round(experts_per_layer * num_experts)
    if slots < 1:
        from ..errors import ConfigError

        raise ConfigError(f"hardware.experts_per_layer={experts_per_layer:g} is {experts_per_layer * num_experts:.3g} "
                          f"of a layer's {num_experts} experts, which rounds to 0 slots: the cache would hold "
                          f"nothing; the smallest fraction that gives one slot is above {0.5 / num_experts:.4g} "
                          f"(or set a whole number of slots, >= 1)")
    return slots


def pool_capacities(geom: Geometry, capacity: float, experts_per_layer: Optional[float], scope: str) -> list[int]:
    """Byte budget of each pool: ``experts_per_layer`` (:func:`slots_per_layer`) whole experts per layer,
    else the fraction ``capacity`` of the model's bytes, truncated to a whole byte (``int``: a budget never
    exceeds what was asked), split evenly between the layers' pools with ``scope=per_layer`` (``//``: each
    pool gets the same whole number of bytes, the remainder, under L bytes, unused)."""
    if experts_per_layer is not None:
        per_layer = slots_per_layer(experts_per_layer, geom.num_experts) * geom.expert_bytes
        return [per_layer] * geom.num_layers if scope == "per_layer" else [per_layer * geom.num_layers]
    total = int(capacity * geom.total_bytes)
    if scope == "per_layer":
        return [total // geom.num_layers] * geom.num_layers
    return [total]
