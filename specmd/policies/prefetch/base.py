"""Prefetch policies (SpecMD §3.1.4) predict experts of later layers and queue them on the channel.

``predict(record, model)`` runs after the current layer's misses are handled and returns
``[(target_layer, [experts in issue order]), ...]``. ``record.predict(target)`` is the prefetch signal:
MoE layer ``target``'s router applied to this call's router input, as ``(probs [T, E], its own top-k
[T, k])`` (family rules included; computed from the model live, read from the trace in replay).
``model`` is the :class:`~specmd.engine.ModelView` (``next_layer``, geometry, ``future`` in replay).
``signal_depth(params)`` says how many layers ahead the policy reads the signal (a replayed trace must
have recorded at least that depth).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...registry import Registry
from ..base import Policy


class PrefetchPolicy(Policy):
    reads_logits = False  # its input is the prefetch signal (read back with the routing), not this call's logits

    @classmethod
    def signal_depth(cls, params: Any) -> int:
        return 1

    def predict(self, record: Any, model: Any) -> list[tuple[int, list[int]]]:
        raise NotImplementedError

    def passive(self) -> bool:
        """True when ``predict`` always answers no prediction: the engine then never calls it. A policy says
        so only of its own ``predict``, so a subclass that overrides ``predict`` is called (see
        :class:`~.none.NoPrefetch`)."""
        return False


PREFETCH: Registry[PrefetchPolicy] = Registry("prefetch", "specmd.policies.prefetch")


def union_by_score(probs: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> list[int]:
    """Unite per-token predictions ``index`` [T, n] (scores ``values``) into one issue order: descending
    highest score of each expert (ties: lower expert index first), so the most confident go first."""
    if probs.shape[0] == 1:  # decode: one token, a handful of predictions: sorted in Python (~3 us, not ~30)
        v, idx = values[0].tolist(), index[0].tolist()
        if all(x == x for x in v):  # (a NaN score sorts last in torch, arbitrarily in Python)
            return [idx[j] for j in sorted(range(len(v)), key=lambda j: -v[j])]  # stable: ties keep their order
        order = torch.argsort(-values[0], stable=True)
        return index[0, order].tolist()
    best = probs.new_full((probs.shape[-1],), -1.0)
    best.scatter_reduce_(0, index.reshape(-1), values.reshape(-1), reduce="amax")
    chosen = (best >= 0).nonzero().squeeze(-1)
    order = torch.argsort(-best[chosen], stable=True)
    return chosen[order].tolist()


def overfetch_count(overfetch: float, top_k: int) -> int:
    """Experts predicted per token for ``overfetch`` (top-``k`` prefetchers): ``ceil(k * overfetch)``, at
    least 1. Rounded *up*: overfetching means predicting more than the router's k, so any excess over a
    whole expert asks for one more (1.1 x 8 = 8.8 -> 9); the 1e-9 keeps a product that is a whole number
    up to float error whole (0.28 x 25 = 7.000000000000001 -> 7, not 8). ``0 < overfetch < 1/k`` predicts
    each token's top-1. More than the layer's experts is an error (:func:`overfetch_errors`), never clamped."""
    return max(1, math.ceil(top_k * overfetch - 1e-9))


def overfetch_errors(overfetch: float, model: Any) -> list[str]:
    n = overfetch_count(overfetch, model.top_k)
    if n <= model.num_experts:
        return []
    return [f"overfetch={overfetch:g} predicts {n} experts per token (ceil of top-k {model.top_k} x {overfetch:g}), "
            f"more than a layer's {model.num_experts}: at most {model.num_experts / model.top_k:g}"]


def topk_prediction(record: Any, target: int, count: int) -> list[int]:
    """Layer ``target``'s router on this call's input: each token's top ``count`` experts (for ``count == k``
    the router's own selection; otherwise the top ``count`` by the family's selection score at ``target`` --
    its selection bias and group limit --, so an overfetch holds the router's own choice), united by
    :func:`union_by_score` in the order of their router probabilities."""
    probs, index = record.predict(target)
    if count == index.shape[-1]:
        values = probs.gather(-1, index)
    elif record.scoring.plain:
        values, index = probs.topk(count, dim=-1)
    else:
        index = record.scoring.selection(probs, target, index).topk(count, dim=-1).indices
        values = probs.gather(-1, index)
    return union_by_score(probs, index, values)
