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

    def __post_init__(self):
        n = self.num_layers
        if not self.dense_params:
            self.dense_params = [0] * n
        if not self.attn_layers:
            self.attn_layers = [0] * n
        if not self.layer_ids:
            self.layer_ids = list(range(n))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Geometry":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def pool_capacities(geom: Geometry, capacity: float, experts_per_layer: Optional[int], scope: str) -> list[int]:
    """Byte budget of each pool."""
    if experts_per_layer is not None:
        per_layer = experts_per_layer * geom.expert_bytes
        return [per_layer] * geom.num_layers if scope == "per_layer" else [per_layer * geom.num_layers]
    total = int(capacity * geom.total_bytes)
    if scope == "per_layer":
        return [total // geom.num_layers] * geom.num_layers
    return [total]
