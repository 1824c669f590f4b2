"""Routing policies (Cache-Conditional Experts §3, SpecMD §3.1.1) modify which experts a token selects.

``apply`` sees the layer's :class:`~specmd.engine.record.GateRecord` (original logits, router
probabilities, the family's selection scores, the router's own selection) and the read-only cache view. A
policy that ranks experts ranks them by the **selection score** (``record.scores``, :func:`selection_ranking`:
the family's rule -- DeepSeek-V3's selection bias, its group-limited top-k), never by the plain logits or
probabilities, so that with no adjustment it returns the router's own choice on every family
(``tests/policies/test_selection.py``). It returns a new ``[T, k]`` index
of selected experts, or ``None`` to keep the router's selection untouched (the lossless fast path). The
engine (``Engine.route``) applies *dual-logit semantics*: the new selection is weighted by the original router probabilities,
renormalised the way the model family does (see ``GateRecord.reweigh``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...engine.record import Routed
from ...registry import Registry
from ..base import Policy


class RoutingPolicy(Policy):
    """A routing policy. The engine asks it once per layer call, :meth:`route`, and gets one value back: a
    :class:`~specmd.engine.record.Routed` (the selection, its weights, the slots it emptied) or None (the
    router's selection untouched). A policy that only re-selects implements :meth:`apply` (the new ``[T, k]``
    index, weighed dual-logit, no slot emptied); one that empties slots or weighs otherwise implements
    :meth:`route` itself, holding no state between calls."""

    def route(self, record: Any, cache: Any) -> Optional[Routed]:
        """This layer call's :class:`~specmd.engine.record.Routed`, or None: :meth:`apply`'s selection,
        weighed dual-logit (:meth:`weigh`), no slot emptied."""
        index = self.apply(record, cache)
        return None if index is None else Routed(index, self.weigh(record, index))

    def apply(self, record: Any, cache: Any):  # -> torch.Tensor | None
        """The new ``[T, k]`` selection, or None (the router's own): :meth:`route`'s index."""
        if type(self).route is RoutingPolicy.route:
            raise NotImplementedError(f"{type(self).__name__} implements neither apply nor route")
        routed = self.route(record, cache)
        return None if routed is None else routed.index

    def passive(self) -> bool:
        """True when ``apply`` always answers None (the router's selection untouched): the engine then
        never calls it. A policy says so only of its own ``apply``, so a subclass that overrides ``apply``
        is called (see :class:`~.standard.Standard`)."""
        return False

    def weigh(self, record: Any, index: torch.Tensor) -> torch.Tensor:
        """Weights of a modified selection: the original probabilities, the family's way (dual-logit)."""
        return record.scoring.weigh(record.probs, index, record.layer)


PASSES = ("decode", "all")  # the passes a batch-aware routing policy acts on (``passes``)


def acts_on(passes: str, cache: Any) -> bool:
    """Whether a policy with ``passes`` (one of :data:`PASSES`) acts on the ongoing pass: ``decode`` leaves
    prefill calls as routed (OEA: "we use it only during decode, not prefill"); a call outside any pass (a
    policy called on its own, ``cache`` None) is acted on."""
    return passes == "all" or cache is None or cache.pass_kind != "prefill"


def weigh_kept(record: Any, index: torch.Tensor, void: Any) -> torch.Tensor:
    """Dual-logit weights of a selection whose ``void`` [T, k] slots are empty (or None: none is): each kept
    slot gets its original probability, renormalised the family's way over the token's *kept* slots only
    (``Scoring.weigh``, so a family that renormalises its top-k renormalises over fewer experts, one that
    does not keeps the raw probabilities), an empty slot 0. Empty slots read a zero-probability column."""
    probs = record.probs
    if void is None:
        return record.scoring.weigh(probs, index, record.layer)
    padded = torch.cat([probs, probs.new_zeros(probs.shape[0], 1)], dim=-1)  # column E: probability 0
    return record.scoring.weigh(padded, index.masked_fill(void, probs.shape[-1]), record.layer)


def selection_ranking(record: Any) -> torch.Tensor:
    """``[T, E]``: every expert by descending selection score (``record.scores``: the family's rule, its
    selection bias and group limit; experts outside a token's groups last), ties by expert id; the first k
    are the router's own top-k. A plain rule ranks the logits (the same order as its probabilities)."""
    if record.scoring.plain:
        return torch.argsort(record.logits, dim=-1, descending=True, stable=True)
    return torch.argsort(record.scores, dim=-1, descending=True, stable=True)


def cache_mask(record: Any, cache: Any, within_groups: bool = True) -> torch.Tensor:
    """``[E]`` bool: experts of the record's layer that are in the cache (arrived or on their way); ``[T, E]``
    where the family's top-k is group-limited and ``within_groups``: the cached experts within each token's
    groups (those its router could select), so a promotion never crosses the group limit."""
    mask = record.logits.new_zeros(record.logits.shape[-1], dtype=torch.bool)
    resident = cache.present(record.layer)
    if resident:
        mask[resident] = True
    if within_groups and record.scoring.groups > 1:
        mask = mask & torch.isfinite(record.scores)
    return mask


def promote_select(ranking: torch.Tensor, cached: torch.Tensor, max_rank: torch.Tensor, top_j: int, k: int):
    """Cache-Conditional Experts' promote() (Algorithms 1 and 2) for every token at once:
    ``r' = promote(r[:J]; promote(r[:M] ∩ C; r))`` and the new selection is ``r'[:k]``.

    ``ranking`` [T, E]: experts by descending selection score; ``cached`` [E] bool, or [T, E] per token;
    ``max_rank`` [T] (M per token). Each expert gets the key (group, rank) with group 0 = top-J, 1 = in the
    top-M and cached, 2 = the rest; sorting by it is exactly the two promotions (order kept within groups)."""
    num = ranking.shape[-1]
    rank = ranking.new_tensor(range(num)).expand_as(ranking)
    in_cache = cached[ranking] if cached.dim() == 1 else cached.gather(-1, ranking)
    group = torch.where(rank < top_j, 0, torch.where(in_cache & (rank < max_rank.unsqueeze(-1)), 1, 2))
    order = torch.argsort(group * num + rank, dim=-1)
    return ranking.gather(-1, order[:, :k])


ROUTING: Registry[RoutingPolicy] = Registry("routing", "specmd.policies.routing")
