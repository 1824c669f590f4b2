"""Prefetch policies (SpecMD §3.1.4) predict experts of later layers and queue them on the channel.

``predict(record, model)`` runs after the current layer's misses are handled and returns
``[(target_layer, [experts in issue order]), ...]``. ``model`` is a
:class:`~specmd.hook.stack.ModelView`: ``model.next_layer(l)``, ``model.router_probs(l, hidden)`` and
``model.router_predict(l, hidden)`` (layer ``l``'s router applied to any hidden state: probabilities with
the family's scoring, and the router's own top-k) are what predictors use.
"""

from __future__ import annotations

from typing import Any

from ...registry import Registry
from ..base import Policy


class PrefetchPolicy(Policy):
    def predict(self, record: Any, model: Any) -> list[tuple[int, list[int]]]:
        raise NotImplementedError


PREFETCH: Registry[PrefetchPolicy] = Registry("prefetch", "specmd.policies.prefetch")
