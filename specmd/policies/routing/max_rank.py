from dataclasses import dataclass

import torch

from .base import ROUTING, RoutingPolicy, cache_mask, promote_select, selection_ranking


@dataclass
class MaxRankParams:
    M: int = 16
    J: int = 1

    def __post_init__(self):
        if self.M < 0 or self.J < 0:
            raise ValueError(f"M={self.M} and J={self.J} must be >= 0")


class MaxRank(RoutingPolicy):
    """Max-Rank (Cache-Conditional Experts, Algorithm 1): cached experts within the router's top ``M`` are
    promoted ahead of uncached ones, the router's top ``J`` always stay first; the new top-k runs, weighted
    by the original probabilities. Ranks are the family's (its selection score: selection bias, group limit),
    so ``M <= k`` leaves the selection unchanged (up to order) on every family; ``M >= E``
    searches every rank (the default 16 on Mixtral's 8 experts): a search depth, not a count of experts, so it
    is not bounded by the model, unlike ``J`` (checked against the top-k by the engine)."""

    name = "max_rank"

    Params = MaxRankParams

    def apply(self, record, cache):
        ranking = selection_ranking(record)  # [T, E], by the family's selection score
        m = ranking.new_full((ranking.shape[0],), self.params.M)
        return promote_select(ranking, cache_mask(record, cache), m, self.params.J, record.top_k)


ROUTING.register(MaxRank)
