from dataclasses import dataclass

import torch

from ..base import check_choice
from .base import PREFETCH, PrefetchPolicy, union_by_score


@PREFETCH.register("score")
class Score(PrefetchPolicy):
    """Score-based prefetch (Zhu et al. 2025; SpecMD §3.1.4): the next layer's router is applied to the
    current router input and every expert whose predicted probability is at or above the ``percentile``-th
    percentile is prefetched. SpecMD: it "filters experts by softmax score rather than fixed top-k count
    and prefetch all experts above a configurable percentile threshold (the default is 80th percentile).
    Unlike top-k approaches, this method adapts the number of prefetched experts based on score
    distribution." The papers do not say over which scores the percentile is taken (``basis``):

    * ``window`` (default): over a window of the target layer's recent predicted scores (all experts of the
      last ``window`` predictions, the current one included). A confident prediction (a few high scores)
      prefetches few experts, a flat one fewer still, and a layer's threshold adapts to how peaked its
      router is: the count adapts, as the text says.
    * ``token``: over each token's own E scores. Then every token prefetches a fixed (100 - percentile)%
      of the experts (ties aside), which is top-k with k = (1 - percentile/100)·E: the count does *not*
      adapt, contradicting the text; kept as the literal "percentile of the softmax scores" reading."""

    @dataclass
    class Params:
        percentile: float = 80.0
        window: int = 64
        basis: str = "window"

        def __post_init__(self):
            if not 0.0 <= self.percentile < 100.0:
                raise ValueError(f"percentile={self.percentile} must be in [0, 100)")
            if self.window < 1:
                raise ValueError(f"window={self.window} must be >= 1")
            check_choice("basis", self.basis, ("window", "token"))

    def setup(self, model):
        self.history = [None] * model.num_layers

    def predict(self, record, model):
        target = model.next_layer(record.layer)
        if target is None:
            return []
        probs, _ = record.predict(target)
        q = self.params.percentile / 100.0
        if self.params.basis == "token":
            threshold = torch.quantile(probs.float(), q, dim=-1, keepdim=True)  # [T, 1]
        else:
            hist = self.history[target]
            hist = (probs if hist is None else torch.cat([hist, probs]))[-self.params.window:]
            self.history[target] = hist
            threshold = torch.quantile(hist.reshape(-1).float(), q)
        above = probs >= threshold
        if not bool(above.any()):
            return [(target, [])]
        tokens, experts = above.nonzero(as_tuple=True)
        index = experts.view(1, -1)
        values = probs[tokens, experts].view(1, -1)
        if probs.shape[0] == 1:
            return [(target, union_by_score(probs, index, values))]
        return [(target, union_by_score(probs, experts.view(-1, 1), values.view(-1, 1)))]
