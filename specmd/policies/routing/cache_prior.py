from dataclasses import dataclass

import torch

from .base import ROUTING, RoutingPolicy, cache_mask


@dataclass
class CachePriorParams:
    lambda_: float = 0.3
    J: int = 2

    def __post_init__(self):
        if not 0.0 <= self.lambda_ <= 1.0:
            raise ValueError(f"lambda={self.lambda_} must be in [0, 1]")


class CachePrior(RoutingPolicy):
    """Cache-Prior (Cache-Conditional Experts, Eq. 9): ``z' = z + lambda * Delta_avg * m~``, where ``m~``
    marks the cached experts plus each token's top-``J`` and ``Delta_avg`` is this layer's running average
    (over all tokens seen so far, this call included) of ``max z - min z``. The top-k of ``z'`` is
    selected; the original probabilities weigh it (dual-logit). ``lambda = 0`` is the router's own choice.
    Family selection rules (DeepSeek group limits) do not apply to the re-ranked choice."""

    name = "cache_prior"

    Params = CachePriorParams

    def setup(self, model):
        self.range_sum = [0.0] * model.num_layers
        self.range_n = [0] * model.num_layers

    def apply(self, record, cache):
        z = record.logits.float()
        layer = record.layer
        self.range_sum[layer] += float((z.amax(-1) - z.amin(-1)).sum())
        self.range_n[layer] += z.shape[0]
        lam = self.params.lambda_
        if lam == 0.0:
            return None
        delta = self.range_sum[layer] / self.range_n[layer]
        boost = cache_mask(record, cache).unsqueeze(0).expand_as(z).clone()
        if self.params.J:
            boost.scatter_(-1, record.original[:, : self.params.J], True)
        z2 = z + (lam * delta) * boost
        return torch.topk(z2, record.top_k, dim=-1).indices


ROUTING.register(CachePrior)
