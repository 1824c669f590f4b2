"""Miss policies (SpecMD §3.1.2) decide what happens to requested experts that are not resident.

``handle`` gets all misses of one layer call at once (some policies, e.g. Zhu's two-pointer schedule,
need the whole set) and returns one :class:`MissAction` per missing expert, in the same order.
Returning ``None`` means "fetch every miss at ``self.fetch_precision``".

Outcomes: ``FETCH`` (blocking transfer at ``precision``, a stored precision name or ``None`` for the
policy's own ``fetch_precision``), ``DROP`` (the expert does not run for this call; its tokens' weight
for it is zeroed, the others are *not* renormalised), ``SUBSTITUTE`` (``substitute`` is a ``[T]`` long
tensor: each token that selected the missing expert uses that resident expert instead, with the missing
expert's weight), ``HOST`` (computed on the host at full precision, in parallel with the layer's
transfers; timed by the hardware profile's host figures).

``setup(model)`` sees the :class:`~specmd.hook.stack.ModelView`; ``model.store`` is the
:class:`~specmd.quant.ExpertStore` (stored precisions, bytes of each).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ...registry import Registry
from ..base import Policy

FETCH = "fetch"
DROP = "drop"
SUBSTITUTE = "substitute"
HOST = "host"


class MissAction(NamedTuple):
    kind: str
    precision: Optional[str] = None  # FETCH: stored precision name; None = the policy's fetch precision
    substitute: Any = None  # SUBSTITUTE: [T] long tensor of replacement experts


class MissPolicy(Policy):
    fetch_precision: str = "native"  # precision of plain fetches and of prefetches

    def handle(self, layer: int, missing: list[int], record: Any, cache: Any) -> Optional[list[MissAction]]:
        raise NotImplementedError


MISS: Registry[MissPolicy] = Registry("miss", "specmd.policies.miss")
