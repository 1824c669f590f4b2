from collections import deque
from dataclasses import dataclass

import numpy as np

from .base import EVICTION, OrderedEviction, argmin_key


@EVICTION.register("score")
class Score(OrderedEviction):
    """Score-based eviction (Zhu et al. 2025; SpecMD App. B): evicts the resident expert with the lowest
    mean gate score over the last ``n`` calls of its layer (decode steps; a prefill pass counts as one
    step, scored by its mean over tokens). The score of an expert at a step is its router probability
    averaged over the step's tokens (every expert of the layer gets one, selected or not); experts of a
    layer not yet seen score 0. The protection shield: the running layer's experts are never evicted
    while it computes (the cache manager's pinning). Ties: lower key first."""


    @dataclass
    class Params:
        n: int = 8

        def __post_init__(self):
            if self.n < 1:
                raise ValueError(f"n={self.n} must be >= 1")

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.history: dict[int, deque] = {}
        self.mean: dict[int, np.ndarray] = {}

    def on_layer(self, layer, record=None):
        if record is None:
            return
        scores = record.probs.mean(0).double().cpu().numpy()
        hist = self.history.setdefault(layer, deque())
        hist.append(scores)
        if len(hist) > self.params.n:
            hist.popleft()
        self.mean[layer] = sum(hist) / len(hist)

    def victim(self, evictable):
        e, mean = self.keys.num_experts, self.mean

        def rank(k):
            m = mean.get(k // e)
            return (0.0 if m is None else float(m[k % e]), k)

        return argmin_key(self._order, evictable, rank)
