from dataclasses import dataclass

import torch

from ...engine.record import Routed
from ..base import ranked_by_score
from .base import ROUTING, RoutingPolicy


@dataclass
class PruneParams:
    """``h``: the experts kept per token (ranks ``0..h-1``). The paper sweeps it ("Pruning and Max-Rank
    use 0, 1, ..., K") and names no default, only its range: "experts ranked >= h (with 1 < h <= k) are
    discarded" (§4.1). Default 2, the one value its measurements support on all four of its models:
    h = 1 is what they rule out ("Removing the second highest ranked expert leads to a performance drop
    across all four models", Fig. 2 left), while "models with more active experts, like Qwen and
    DeepSeek, recover quickly" once the top two are kept (Fig. 2; likewise its top-J of 2 for them).
    h = 4 breaks the paper's own range on Mixtral and Phi-MoE (k = 2: 4 > k; rejected by
    :meth:`model_errors`); h = 2 is their router's own choice there and prunes the granular models."""

    h: int = 2

    def __post_init__(self):
        if self.h < 1:
            raise ValueError(f"h={self.h} must be >= 1")


class Prune(RoutingPolicy):
    """Pruning baseline (Cache-Conditional Experts §4.1): experts the router ranks ``>= h`` (0-based, by the
    family's selection score) are not
    run; the kept ``h`` keep their probabilities, renormalised over the kept set exactly when the family
    renormalises its top-k (Mixtral, Qwen3: yes; OLMoE: no). ``h = k`` is the router's own choice. Pruned
    slots point at the token's top-1 expert with weight 0 (no request, no contribution), so every family's
    fused kernel sees its usual ``[T, k]`` shape; results.json's ``miss_rate_vs_router`` normalises misses by
    the router's own (unpruned) requests, the paper's "normalised by k"."""

    name = "prune"

    Params = PruneParams

    @classmethod
    def model_errors(cls, params, model):
        if params.h > model.top_k:
            return [f"h={params.h} exceeds the model's top-k {model.top_k} (h experts are kept per token; h = "
                    f"{model.top_k} is the router's own choice)"]
        return []

    def route(self, record, cache):
        k = record.top_k
        h = self.params.h
        if h >= k:
            return None
        index = ranked_by_score(record.scores, record.original)  # [T, k], rank 0 first
        index[:, h:] = index[:, :1]  # the emptied ranks point at the token's top-1
        void = index.new_zeros(index.shape, dtype=torch.bool)
        void[:, h:] = True
        w = record.scoring.weigh(record.probs, index[:, :h], record.layer)  # the kept ranks, renormalised
        weights = w.new_zeros(index.shape)
        weights[:, :h] = w
        return Routed(index, weights, void)


ROUTING.register(Prune)
