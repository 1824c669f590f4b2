from dataclasses import dataclass

import torch

from ..base import ranked_by_score
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

    The top-k of ``z'`` is taken by the family's own rule (:meth:`Scoring.select
    <specmd.engine.record.Scoring.select>`): the paper's Eq. 9 boosts the *logits*, and a DeepSeek-V3-style
    router selects on ``sigmoid(z') + bias`` within its best groups, so the boost competes with the
    selection bias and the group limit as the router would see it, and ``lambda -> 0`` tends to the router's
    own choice on every family (re-ranking the plain ``z'`` reported 15% routing fidelity at ``lambda =
    0.001`` on a biased DeepSeek-V3, issue 55). The top-``J`` are the token's best by selection score."""

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
        # every cached expert is boosted; the family's rule then picks the groups from the boosted scores
        boost = cache_mask(record, cache, within_groups=False).unsqueeze(0).expand_as(z).clone()
        if self.params.J:  # (a router's top-k columns need not be in rank order: DeepSeek's topk(sorted=False))
            boost.scatter_(-1, ranked_by_score(record.scores, record.original)[:, : self.params.J], True)
        z2 = z + (lam * delta) * boost
        return record.scoring.select(z2, layer, record.top_k, record.original)


ROUTING.register(CachePrior)
