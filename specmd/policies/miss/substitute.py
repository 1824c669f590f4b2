from dataclasses import dataclass

import torch

from .base import MISS, Fetched, MissPolicy, Substituted


@dataclass
class SubstituteParams:
    alpha: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} must be in [0, 1]")


class Substitute(MissPolicy):
    """Expert substitution (Zhu et al. 2025, Algorithm 1 "expert-cache router"; SpecMD §3.1.2). For each
    token, ``S_{k+1}`` is its (k+1)-th highest score. A selected expert is *low-score* for the token if
    ``S_{k+1} <= s < (1 + alpha) S_{k+1}``; it may be replaced by an expert the token did not select that is
    resident (arrived) and scores ``(1 - alpha) S_{k+1} < s <= S_{k+1}`` (the highest such one not already
    used as a substitute for that token). It keeps the missing expert's weight.

    A missing expert is substituted when every token that selected it can be served this way; otherwise
    it is fetched (one transfer serves all its tokens, and the other tokens then stay exact). Scores are the
    family's selection scores (``record.scores``: router probabilities, softmax or sigmoid, plus a selection
    bias; an expert outside the token's groups is never a substitute), so ``alpha = 0`` substitutes nothing.
    Zhu et al.'s window is multiplicative, made for positive probabilities: where a selection bias makes
    ``S_{k+1} <= 0`` the window is empty and the miss is fetched."""

    name = "substitute"

    Params = SubstituteParams

    def handle(self, layer, missing, record, cache):
        if layer in record.scoring.hashed:  # a hash-routed layer's choice is the token's, not a score's: fetched
            return None
        probs = record.scores  # the family's selection score (-inf outside a token's groups: never eligible)
        k = record.top_k
        if k >= probs.shape[-1]:
            return None
        a = self.params.alpha
        s_k1 = torch.topk(probs, k + 1, dim=-1).values[:, k]  # [T]
        resident = probs.new_zeros(probs.shape[-1], dtype=torch.bool)
        ids = cache.resident(layer)
        if ids:
            resident[ids] = True
        selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, record.index, True)
        eligible = resident & ~selected & (probs > (1 - a) * s_k1[:, None]) & (probs <= s_k1[:, None])
        actions = []
        for e in missing:
            tokens = (record.index == e).any(-1)
            low = probs[tokens, e] < (1 + a) * s_k1[tokens]
            cand = eligible[tokens]
            if not bool(low.all()) or not bool(cand.any(-1).all()):
                actions.append(Fetched())
                continue
            pick = torch.where(cand, probs[tokens], torch.full_like(probs[tokens], -1.0)).argmax(-1)
            sub = probs.new_full((probs.shape[0],), e, dtype=torch.long)
            sub[tokens] = pick
            eligible[tokens.nonzero().squeeze(-1), pick] = False
            actions.append(Substituted(sub))
        return actions


MISS.register(Substitute)
