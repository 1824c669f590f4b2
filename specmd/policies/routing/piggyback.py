from dataclasses import dataclass

import torch

from ...engine.record import Routed
from ..base import check_choice, ranked_by_score
from .base import PASSES, ROUTING, RoutingPolicy, acts_on, weigh_kept


@dataclass
class PiggybackParams:
    k0: int = 3
    passes: str = "decode"  # decode | all: the passes it acts on (the paper: decode only)

    def __post_init__(self):
        if self.k0 < 1:
            raise ValueError(f"k0={self.k0} must be >= 1 (the top-k0 experts every token keeps)")
        check_choice("passes", self.passes, PASSES)


class Piggyback(RoutingPolicy):
    """Opportunistic Expert Activation (OEA; Oncescu, Wu, Chung, Wu, Gopal, Wang, Dao, Athiwaratkun,
    arXiv 2511.02237, "Batch-Aware Expert Routing for Faster Decode Without Retraining"), its simplified
    Algorithm 1, the one the paper evaluates downstream. Per layer call (the live tokens of the batch):

    1. *baseline*: every token keeps its router's top ``k0`` experts, ``S_i^base = {e_i1, ..., e_ik0}``;
    2. *piggybacking*: ``S^base`` is the union of the baselines, the experts the layer loads anyway; each
       token adds, in decreasing router probability, its experts that are in ``S^base`` (and not already its
       own), until it has ``k``: "routing tokens to additional, lower-priority experts only if those experts
       already need to be loaded due to another token's baseline requirement within the same batch".

    The call's distinct experts are then exactly ``|S^base|`` ("thus maintaining the number of activated
    experts T = |S^base|"), and a token uses up to ``k`` of them. The choices the paper's words decide:

    * **Candidates are not limited to the router's own top-k**: Algorithm 1 scans ``j = k0+1 .. N``; the
      general Algorithm 2's rank bound ``maxP`` was dropped because "Setting maxP < N does not help" (its
      ablation: maxP = 8 "strictly hurting" proves "using out-of-policy experts confers a strict advantage").
      Algorithm 2's other knobs are Algorithm 1's values too: ``p = 1`` ("Using p < 1 does not help") and
      ``k^max = k`` ("k^max = k works best"), so ``k0`` is the one parameter ("k0 itself controls both the
      guaranteed baseline quality and the drop in activated experts").
    * **At most k per token**: the text bounds the set by ``k^max = k`` ("the number of selected experts does
      not exceed k^max"); Algorithm 1's listing breaks on ``|S_i| > k`` *before* adding, which would let a
      token reach ``k + 1``, a slip the text and the fixed ``[T, k]`` shape both rule out.
    * **Fewer than k when the union has fewer**: the token's sets are the baseline plus what ``S^base`` holds;
      nothing else is added ("Instead of adding any new experts into the mix"). A slot the union cannot fill
      stays empty (:attr:`Routed.void`, as ``prune`` does: it points at the token's top-1 with weight 0, no
      request, not faithful); keeping the router's own choice there would load an expert outside ``S^base``
      and break the paper's ``T = |S^base|``. Every token of a call then runs ``min(k, |S^base|)`` experts
      (``S^base`` minus a token's own baseline holds ``|S^base| - k0`` candidates, whichever the token).
    * **Weights**: "we keep the model's original router scores and renormalize them following Equation (1)"
      (the sum over the token's set ``S_i``): dual-logit semantics, renormalised over the kept slots the
      family's way (Eq. 1's normalisation "is optional, but enabled in Qwen3"; OLMoE's router keeps raw
      probabilities, and so does this policy on OLMoE).
    * **One token** (batch 1, or the last live sequence): ``S^base`` is the token's own top ``k0``, so nothing
      piggybacks and the call is ``prune`` with ``h = k0`` ("a batch size of 1 deems the piggy-backing
      redundant"). Larger calls approach the router's own routing ("Larger batches naturally increase
      S^base"); a call where every token gets its own top-k back is left unchanged (``apply`` answers None).

    ``k0`` default 3: the paper's headline, "latency reductions of 39% for k0 = 3" at batch 16 on Qwen3-30B-A3B
    (top-8 of 128; Table 3: 106.8 us vs 175.7 us; Table 4: 25.1 vs 48.8 activated experts), "without any
    statistically significant loss in accuracy" (abstract; Table 1: AIME24 80.0 vs 80.4, MATH500 93.5 vs
    92.8, where top-3 pruning alone falls to 51.2 on AIME24). On Qwen3-235B its measured point is k0 = 5
    (-15%). ``k0 = k`` is the router's own choice, ``k0 > k`` is refused (the paper: "it should never help to
    set k0 > k"; on a top-2 model such as Mixtral set k0 = 1). The paper routes this way only in decode
    ("we use it only during decode, not prefill"): ``passes: decode`` (the default) leaves prefill calls as
    routed; ``passes: all`` piggybacks there too (a prefill's many tokens make ``S^base`` nearly every
    expert, and few tokens change).
    Ranks are by the family's selection score (``record.scores``: router probability plus a selection bias,
    within the token's groups where top-k is group-limited), so a token piggybacks only on experts its own
    router could have selected (an expert outside its groups scores ``-inf`` and is no candidate)."""

    name = "piggyback"
    reads_logits = True  # (Policy.reads_logits): ranks every expert by the router's probabilities

    Params = PiggybackParams

    @classmethod
    def model_errors(cls, params, model):
        if params.k0 > model.top_k:
            return [f"k0={params.k0} exceeds the model's top-k {model.top_k} (k0 in 1..{model.top_k}: every token "
                    f"keeps its top k0; k0 = {model.top_k} is the router's own choice)"]
        return []

    def select(self, record):
        """``(index [T, k], void [T, k])``: each token's top ``k0``, then its best experts from the union of
        the call's baselines, in decreasing probability; slots the union cannot fill are void and point at
        the token's top-1."""
        k = record.top_k
        k0 = self.params.k0
        scores = record.scores  # the family's selection score: -inf outside a token's groups
        base = ranked_by_score(scores, record.original)[:, :k0]  # [T, k0], rank 0 first
        union = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        union[base.reshape(-1)] = True
        own = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, base, True)
        score = scores.float().masked_fill(own | ~union, float("-inf"))  # candidates: in S^base, not the token's own
        value, order = torch.sort(score, dim=-1, descending=True, stable=True)
        extra, ok = order[:, : k - k0], value[:, : k - k0] > float("-inf")
        index = torch.cat([base, torch.where(ok, extra, base[:, :1])], dim=1)
        void = torch.cat([torch.zeros_like(base, dtype=torch.bool), ~ok], dim=1)
        return index, void

    def route(self, record, cache):
        if self.params.k0 >= record.top_k or record.tokens == 0 or not acts_on(self.params.passes, cache):
            return None
        index, void = self.select(record)
        if not bool(void.any()) and torch.equal(index.sort(-1).values, record.original.sort(-1).values):
            return None  # every token got its own top-k back: the router's selection, untouched
        return Routed(index, weigh_kept(record, index, void), void)


ROUTING.register(Piggyback)
