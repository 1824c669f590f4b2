"""The unified gate-output record of one MoE layer call (SpecMD App. A.1): no policy knows a family."""

from __future__ import annotations

import torch


class Scoring:
    """How a family turns router logits into probabilities and top-k weights (from its adapter)."""

    __slots__ = ("sigmoid", "renorm", "scale")

    def __init__(self, sigmoid: bool, renorm: bool, scale: float):
        self.sigmoid = sigmoid
        self.renorm = renorm
        self.scale = scale

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)

    def weigh(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        w = probs.gather(-1, index)
        if self.renorm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            w = w * self.scale
        return w


class GateRecord:
    """Selected experts, their weights, full router logits and router probabilities of one layer call.

    ``index``/``weights`` are what will run; ``original`` is the router's own top-k index.
    ``hidden`` is the router input ``[T, H]`` (what prefetch predictors apply later routers to).
    ``probs`` is computed on first use.
    """

    __slots__ = ("layer", "hidden", "logits", "weights", "index", "original", "scoring", "_probs")

    def __init__(self, layer, hidden, logits, weights, index, scoring: Scoring):
        self.layer = layer
        self.hidden = hidden
        self.logits = logits
        self.weights = weights
        self.index = index
        self.original = index  # the router's own selection (routing policies replace ``index``)
        self.scoring = scoring
        self._probs = None

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = self.scoring.probs(self.logits)
        return self._probs

    @property
    def tokens(self) -> int:
        return self.index.shape[0]

    @property
    def top_k(self) -> int:
        return self.index.shape[-1]

    def reweigh(self, index: torch.Tensor) -> torch.Tensor:
        """Dual-logit semantics: weights of a (modified) selection from the *original* probabilities."""
        return self.scoring.weigh(self.probs, index).to(self.weights.dtype)
