import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...engine.record import Routed
from ..base import check_choice, ranked_by_score
from .base import PASSES, ROUTING, RoutingPolicy, acts_on, weigh_kept

BY = ("mass", "count")
OVERFLOW = ("substitute", "drop")


def budget_of(params, num_experts: int) -> int:
    """The distinct experts a call of a layer with ``num_experts`` experts may run: ``max_experts``, or
    ``max_fraction`` of the layer rounded down ("at most"; the epsilon keeps 0.3 * 10 at 3)."""
    if params.max_experts is not None:
        return params.max_experts
    return math.floor(params.max_fraction * num_experts + 1e-9)


@dataclass
class BudgetParams:
    max_experts: Optional[int] = None
    max_fraction: Optional[float] = 0.25
    by: str = "mass"
    overflow: str = "substitute"
    passes: str = "decode"  # decode | all: the passes it caps (a prefill needs most of the layer)

    def __post_init__(self):
        if (self.max_experts is None) == (self.max_fraction is None):
            raise ValueError(f"max_experts={self.max_experts} and max_fraction={self.max_fraction}: set exactly "
                             f"one of them (the other null)")
        if self.max_experts is not None and self.max_experts < 1:
            raise ValueError(f"max_experts={self.max_experts} must be >= 1 (distinct experts per layer call)")
        if self.max_fraction is not None and not 0.0 < self.max_fraction <= 1.0:
            raise ValueError(f"max_fraction={self.max_fraction} must be in (0, 1] (a share of the layer's experts)")
        check_choice("by", self.by, BY)
        check_choice("overflow", self.overflow, OVERFLOW)
        check_choice("passes", self.passes, PASSES)


class Budget(RoutingPolicy):
    """An expert budget per layer call: at most ``max_experts`` distinct experts (or ``max_fraction`` of the
    layer's experts, rounded down; exactly one of the two is set) run for the call's live tokens. A call whose
    router selection already fits is unchanged (``apply`` answers None). Otherwise the budget is the
    best-scored experts of the router's own union, and each token's selections outside it are substituted or
    dropped. Never more than the budget's experts run, however many tokens the call has.

    Not one paper's algorithm: the hard cap is the plainest batch-aware reduction, the family of Lynx (Gupta
    et al., arXiv 2411.08982, "Dynamic Batch-Aware Expert Selection"), whose own scorer (AffinityBinning) sizes
    the set itself. OEA (arXiv 2511.02237, ``routing=piggyback``) describes Lynx's approach as subtractive:
    "first the union of experts that would normally be activated is computed; then, the least popular among
    these experts are dropped". The readings, each a parameter:

    * ``by`` -- which experts make the budget. ``mass`` (default): the largest total router probability of
      the selections, ``sum_t p[t, e]`` over the tokens that selected ``e`` (router probabilities: a selection
      bias balances load and says nothing of a token's preference); ``count``: the most token selections
      (ties: by mass, then the lower expert id). Lynx argues against counting: "Naive voting schemes that tally top-k selections across the batch treat all selections as equally weighted: a
      weakly preferred expert of an indifferent token receives the same vote as the decisive top choice of a
      high-conviction token." Both pick from the router's union (subtractive): no expert the router did not
      ask for is loaded, so the budget's experts are all requests the router made.
    * ``overflow`` -- a selection outside the budget. ``substitute`` (default): the token's best in-budget
      expert by the family's selection score (within its groups) that it has not selected takes the slot
      (none left, e.g. a budget below top-k: the slot is empty); ``drop``: the slot is empty (:attr:`Routed.void`, as ``prune`` declares: weight 0, no request, not
      faithful). Substitution is Lynx's: its remapper "redirects low-confidence token-to-expert assignments
      to experts within that set" and "preserves the top-k activation semantics of the underlying model:
      every token still activates exactly k experts". OEA measures what filling slots from the experts the
      batch loads anyway buys over dropping: top-3 pruning scores 51.2 on AIME24 (Qwen3-30B-A3B), top-3 plus
      piggybacking 80.0, vanilla 80.4 (its Table 1).
    * Weights: dual-logit semantics, the original probabilities of the slots that run, renormalised the
      family's way over them (both papers renormalise after rerouting: OEA's Eq. 1, Lynx's final kernel
      "renormalizes weights").

    Default ``max_fraction: 0.25``: a fraction scales with the layer where a count does not (16 experts is
    twice Mixtral's layer); a quarter of the layer is at least the top-k of every shipped model (Mixtral 2
    of 8, OLMoE 8 of 64, Qwen3 8 of 128), so one token always fits and the budget binds only on calls that
    batch several: on Qwen3-30B at batch 16 it is 32 experts, between OEA's measured active sets at k0 = 4
    and 5 (29.9 and 35.1 experts, Table 4) and two thirds of vanilla routing's 48.8. Both papers reduce
    experts only in decode (Lynx: "no intervention during compute-bound phases"): ``passes: decode`` (the
    default) leaves prefill calls as routed; ``passes: all`` caps every layer call, a prefill's too."""

    name = "budget"
    reads_logits = True  # (Policy.reads_logits): the budget's order and the substitutes read the probabilities

    Params = BudgetParams

    num_experts = 0  # the model's experts (setup); 0: every router column is one (a policy used on its own)

    def setup(self, model) -> None:
        self.num_experts = model.num_experts  # (a router may score more columns: identity experts)

    def limit(self, num_experts: int) -> int:
        """The budget: distinct experts a call of a layer with ``num_experts`` experts may run."""
        return budget_of(self.params, num_experts)

    @classmethod
    def model_errors(cls, params, model):
        E = model.num_experts
        if params.max_experts is not None and params.max_experts > E:
            return [f"max_experts={params.max_experts} exceeds the model's {E} experts per layer (1..{E})"]
        if params.max_fraction is not None and budget_of(params, E) < 1:
            return [f"max_fraction={params.max_fraction} is {params.max_fraction * E:.3g} of a layer's {E} experts, "
                    f"which rounds down to 0: at least {1 / E:.6g} (one expert)"]
        return []

    def select(self, record):
        """``(index [T, k], void [T, k])``, or None when the router's selection fits the budget."""
        original = record.original
        T, k = original.shape
        probs = record.probs
        W = probs.shape[-1]  # router columns: the E experts, then identity experts (LongCat-Flash's: no cost)
        E = self.num_experts or W
        b = self.limit(E)
        chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, original, True)  # [T, W]
        count = chosen.sum(0)
        if W > E:  # an identity expert is never over the budget: not counted, ranked last, always kept
            count[E:] = -1
        if int((count > 0).sum()) <= b:
            return None
        mass = (probs.float() * chosen).sum(0)
        if W > E:
            mass[E:] = -1.0
        first, then = (mass, count) if self.params.by == "mass" else (count, mass)
        order = torch.argsort(then, descending=True, stable=True)  # ties of `first`: by `then`, then expert id
        order = order[torch.argsort(first[order], descending=True, stable=True)]
        kept_set = torch.zeros(W, dtype=torch.bool, device=probs.device)
        kept_set[order[:b]] = True  # (the union has more than b experts, all ranked before the rest)
        kept_set[E:] = True
        scores = record.scores  # the family's selection score: -inf outside a token's groups
        ranked = ranked_by_score(scores, original)  # [T, k], rank 0 first
        keep = kept_set[ranked]
        n_keep = keep.sum(1, keepdim=True)
        ranked = ranked.gather(1, torch.argsort((~keep).to(torch.int8), dim=1, stable=True))  # kept first
        slot = torch.arange(k, device=probs.device).expand(T, k)
        valid = slot < n_keep
        index = ranked
        if self.params.overflow == "substitute":
            score = scores.float().masked_fill(chosen | ~kept_set, float("-inf"))  # in budget, not the token's own
            value, subs = torch.sort(score, dim=-1, descending=True, stable=True)
            nth = (slot - n_keep).clamp(min=0)  # the n-th substitute fills the n-th slot after the kept ones
            index = torch.where(valid, ranked, subs.gather(1, nth))
            valid = valid | (value.gather(1, nth) > float("-inf"))
        void = ~valid
        # an empty slot points at an expert that runs anyway: the token's first slot, or the budget's best
        fill = torch.where(valid[:, 0], index[:, 0], order[0])
        index = torch.where(void, fill.unsqueeze(1), index)
        return index, void

    def route(self, record, cache):
        if record.tokens == 0 or not acts_on(self.params.passes, cache):
            return None
        made = self.select(record)
        if made is None:
            return None
        index, void = made
        return Routed(index, weigh_kept(record, index, void), void)


ROUTING.register(Budget)
