"""Prefetch policies (SpecMD §3.1.4) predict experts of later layers and queue them on the channel.

``predict(record, model)`` runs after the current layer's misses are handled and returns
``[(target_layer, [experts in issue order]), ...]``. ``model`` is a
:class:`~specmd.hook.stack.ModelView`: ``model.next_layer(l)``, ``model.router_probs(l, hidden)`` and
``model.router_predict(l, hidden)`` (layer ``l``'s router applied to any hidden state: probabilities with
the family's scoring, and the router's own top-k) are what predictors use.
"""

from __future__ import annotations

from typing import Any

import torch

from ...registry import Registry
from ..base import Policy


class PrefetchPolicy(Policy):
    def predict(self, record: Any, model: Any) -> list[tuple[int, list[int]]]:
        raise NotImplementedError


PREFETCH: Registry[PrefetchPolicy] = Registry("prefetch", "specmd.policies.prefetch")


def union_by_score(probs: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> list[int]:
    """Unite per-token predictions ``index`` [T, n] (scores ``values``) into one issue order: descending
    highest score of each expert (ties: lower expert index first), so the most confident go first."""
    if probs.shape[0] == 1:  # decode: one token
        order = torch.argsort(-values[0], stable=True)
        return index[0, order].tolist()
    best = torch.full((probs.shape[-1],), -1.0, dtype=probs.dtype, device=probs.device)
    best.scatter_reduce_(0, index.reshape(-1), values.reshape(-1), reduce="amax")
    chosen = (best >= 0).nonzero().squeeze(-1)
    order = torch.argsort(-best[chosen], stable=True)
    return chosen[order].tolist()


def topk_prediction(model: Any, target: int, hidden: torch.Tensor, count: int) -> list[int]:
    """Layer ``target``'s router on ``hidden``: each token's top ``count`` experts (for ``count == k`` the
    router's own selection, family rules included), united by :func:`union_by_score`."""
    probs, index = model.router_predict(target, hidden)
    if count == index.shape[-1]:
        values = probs.gather(-1, index)
    else:
        values, index = probs.topk(count, dim=-1)
    return union_by_score(probs, index, values)
