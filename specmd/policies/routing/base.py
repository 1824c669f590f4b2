"""Routing policies (Cache-Conditional Experts §3, SpecMD §3.1.1) modify which experts a token selects.

``apply`` sees the layer's :class:`~specmd.hook.gate.GateRecord` (original logits, router probabilities,
the router's own selection) and a read-only view of the cache. It returns a new ``[T, k]`` index of
selected experts, or ``None`` to keep the router's selection untouched (the lossless fast path). The hook
applies *dual-logit semantics*: the new selection is weighted by the original router probabilities,
renormalised the way the model family does (see ``GateRecord.reweigh``).
"""

from __future__ import annotations

from typing import Any

from ...registry import Registry
from ..base import Policy


class RoutingPolicy(Policy):
    def apply(self, record: Any, cache: Any):  # -> torch.Tensor | None
        raise NotImplementedError


ROUTING: Registry[RoutingPolicy] = Registry("routing", "specmd.policies.routing")
