from dataclasses import dataclass

import torch

from ..base import ranked_by_score
from .base import ROUTING, RoutingPolicy


@dataclass
class ReplaceRankParams:
    rank: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"rank={self.rank} must be >= 0 (0 = the top-1 expert)")


class ReplaceRank(RoutingPolicy):
    """Expert sensitivity by rank (Cache-Conditional Experts §3, Fig. 2 right): "we replaced the expert ranked
    k with a randomly selected expert" -- every token's expert at ``rank`` (0-based, 0 = the top-1) is swapped
    for an expert drawn uniformly from those the token did not select, keeping the number of active experts.

    The paper does not say which weight the substitute gets. Here it is weighted like every modified selection
    in specmd (dual-logit semantics, ``RoutingPolicy.weigh``): by its own router probability, renormalised
    the family's way -- a random expert usually has a small probability, so on families that do not
    renormalise (OLMoE) the swap mostly removes the replaced expert's contribution, and on those that do
    (Mixtral) the kept experts' weights grow. The draws come from a generator seeded with ``seed``, so a live
    run and its replay swap the same experts."""

    name = "replace_rank"

    Params = ReplaceRankParams

    def __init__(self, params=None):
        super().__init__(params)
        self.gen = torch.Generator().manual_seed(self.params.seed)

    @classmethod
    def model_errors(cls, params, model):
        if params.rank >= model.top_k:
            return [f"rank={params.rank}: the router selects ranks 0..{model.top_k - 1} (top-k {model.top_k}), so "
                    f"there is no expert at rank {params.rank} to replace"]
        return []

    def apply(self, record, cache):
        if self.params.rank >= record.top_k:
            return None  # the router selects no expert at this rank: nothing to replace
        index = ranked_by_score(record.scores, record.original)  # [T, k], rank 0 first
        noise = torch.rand(index.shape[0], record.probs.shape[-1], generator=self.gen)  # [T, E]
        noise.scatter_(1, index.cpu(), -1.0)  # never draw an expert the token already selected
        index[:, self.params.rank] = noise.argmax(dim=1).to(index.device)
        return index


ROUTING.register(ReplaceRank)
