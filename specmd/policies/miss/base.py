"""Miss policies (SpecMD §3.1.2) decide what happens to requested experts that are not resident.

``handle`` gets all misses of one layer call at once (some policies, e.g. Zhu's two-pointer schedule,
need the whole set) and returns one :class:`MissAction` per missing expert, in the same order.
Returning ``None`` means "fetch every miss at the stored (native) precision".
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ...registry import Registry
from ..base import Policy

FETCH = "fetch"
DROP = "drop"


class MissAction(NamedTuple):
    kind: str  # FETCH or DROP (later: substitute, host)
    precision: Optional[str] = None  # None = native precision


class MissPolicy(Policy):
    def handle(self, layer: int, missing: list[int], record: Any, cache: Any) -> Optional[list[MissAction]]:
        raise NotImplementedError


MISS: Registry[MissPolicy] = Registry("miss", "specmd.policies.miss")
