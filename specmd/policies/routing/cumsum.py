from dataclasses import dataclass

import torch

from .base import ROUTING, RoutingPolicy, cache_mask, promote_select, selection_ranking


@dataclass
class CumsumParams:
    p: float = 0.5
    J: int = 1

    def __post_init__(self):
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p={self.p} must be in [0, 1]")


class Cumsum(RoutingPolicy):
    """Cumulative-sum threshold (Cache-Conditional Experts, Algorithm 2): per token, ``M`` is the number of
    top-ranked experts whose router probabilities first reach ``p`` (``M = 0`` for ``p = 0``), then Max-Rank
    with that ``M`` and top-``J`` kept. Probabilities are the family's (softmax, or sigmoid scores); the ranks
    are its selection score's (a selection bias, a group limit), so ``p = 0`` is the router's own choice."""

    name = "cumsum"

    Params = CumsumParams

    def apply(self, record, cache):
        probs = record.probs
        if record.scoring.plain:
            sorted_p, ranking = torch.sort(probs, dim=-1, descending=True, stable=True)
        else:  # ranked by the family's selection score, the probabilities summed in that order
            ranking = selection_ranking(record)
            sorted_p = probs.gather(-1, ranking)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # p_cum before adding the M-th expert
        m = (before < self.params.p).sum(-1)
        if self.params.p <= 0:
            m = torch.zeros_like(m)
        return promote_select(ranking, cache_mask(record, cache), m, self.params.J, record.top_k)


ROUTING.register(Cumsum)
