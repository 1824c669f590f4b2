"""Miss policies (SpecMD §3.1.2) decide what happens to requested experts that are not resident.

``handle(layer, missing, record, cache)`` gets all misses of one layer call at once (some policies, e.g.
Zhu's two-pointer schedule, need the whole set), the layer's :class:`~specmd.engine.record.GateRecord` and
the read-only :class:`~specmd.engine.view.CacheView` (what is cached; its ``clock``, a
:class:`~specmd.engine.view.ClockView`: what a transfer or the host's compute costs, when the link is free),
and returns one outcome per missing expert, in the same order (``None`` means "fetch every miss at ``self.fetch_precision``").

Outcomes (:mod:`specmd.engine.outcomes`, each one class whose ``serve`` is one verb of the layer call, which
does the accounting and says how the layer executes together): ``Fetched(precision)`` (blocking transfer at
a stored precision; ``None`` = the policy's ``fetch_precision``), ``Dropped()`` (the expert does not run for this call; its tokens' weight for it is
zeroed, the others are *not* renormalised), ``Substituted(substitute)`` (a ``[T]`` long tensor: each token
that selected the missing expert uses that resident expert instead, with the missing expert's weight),
``HostComputed()`` (computed on the host at full precision, in parallel with the layer's transfers; timed by the
hardware profile's host figures).

``setup(model)`` sees the :class:`~specmd.engine.ModelView`; ``model.store`` holds the stored precisions
and the bytes of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...engine.outcomes import Dropped, Fetched, HostComputed, Outcome, Substituted  # noqa: F401  (what handle returns)
from ...registry import Registry
from ..base import Policy, ranked_by_score


class MissPolicy(Policy):
    fetch_precision: str = "native"  # precision of plain fetches and of prefetches

    @classmethod
    def lossless(cls, params: Any) -> bool:
        """True if every requested expert runs exactly (the model computes what it would unhooked)."""
        return False

    @classmethod
    def computes_on_host(cls, params: Any) -> bool:
        """True if it may answer ``HostComputed()``: an offloaded run then gives the host lane threads of its own
        when it is a thread (``execution.host_threads``, :class:`specmd.machine.CorePlan`)."""
        return False

    @classmethod
    def required_precisions(cls, params: Any) -> list[str]:
        """Stored precisions this configuration needs (checked against ``quant`` before a model loads)."""
        return []

    def handle(self, layer: int, missing: list[int], record: Any, cache: Any) -> Optional[list[Outcome]]:
        raise NotImplementedError

    def passive(self) -> bool:
        """True when ``handle`` always answers None (every miss fetched at ``fetch_precision``): the cache
        manager then never calls it. A policy says so only of its own ``handle``, so a subclass that
        overrides ``handle`` is called (see :class:`~.fetch.Fetch`)."""
        return False


MISS: Registry[MissPolicy] = Registry("miss", "specmd.policies.miss")


@dataclass
class CascadeParams:
    """A precision cascade (highest first, ``int8:4:2``) and the score percentile below which misses are
    degraded."""

    precisions: str = "int8:4:2"
    percentile: float = 60.0

    def __post_init__(self):
        self.cascade = parse_cascade(self.precisions)
        if not 0.0 <= self.percentile <= 100.0:
            raise ValueError(f"percentile={self.percentile} must be in [0, 100]")


class CascadeMissPolicy(MissPolicy):
    """Base of the precision-cascade policies: checks the cascade against the stored precisions and
    fetches (and prefetches) at its highest precision by default."""

    Params = CascadeParams

    @classmethod
    def required_precisions(cls, params):
        return list(params.cascade)

    def setup(self, model):
        model.store.check(self.params.cascade, f"miss={self.name}")
        self.fetch_precision = self.params.cascade[0]


def expert_scores(record: Any, experts: list[int]):
    """Importance of each listed expert in this layer call: its highest selection score (``record.scores``:
    the router probability plus the family's selection bias) over the tokens that selected it (``-inf`` if
    none did). Returns a float tensor [len(experts)]."""
    import torch

    scores = record.scores
    idx = scores.new_tensor(experts, dtype=torch.long)
    selected = (record.index.unsqueeze(-1) == idx).any(1)  # [T, n]
    return torch.where(selected, scores[:, idx], scores.new_full((), float("-inf"))).amax(0).float().cpu()


def best_ranks(record: Any, experts: list[int]) -> list[int]:
    """Each listed expert's best (lowest, 0-based) rank among the tokens that selected it, ranks being
    positions in the token's selection by descending selection score (k if no token selected it)."""
    ranked = ranked_by_score(record.scores, record.index)  # [T, k] by descending selection score
    k = ranked.shape[-1]
    out = []
    for e in experts:
        pos = (ranked == e).nonzero()
        out.append(int(pos[:, 1].min()) if len(pos) else k)
    return out


def parse_cascade(spec: str) -> list[str]:
    """``"int8:4:2"`` -> ``["int8", "int4", "int2"]`` (a bare number repeats the previous prefix). Every
    precision must be one specmd stores, and the cascade runs from the highest precision down (the most
    important misses get the first): ``int4:8`` would give them int4, so it is rejected, not run backwards."""
    from ...engine.store import BITS

    out, prefix = [], "int"
    for part in str(spec).split(":"):
        part = part.strip()
        if not part:
            raise ValueError(f"empty precision in {spec!r}")
        if part[0].isdigit():
            out.append(f"{prefix}{part}")
        else:
            out.append(part)
            prefix = part.rstrip("0123456789") or "int"
    unknown = [p for p in out if p not in BITS]
    if unknown:
        raise ValueError(f"precisions={spec!r}: unknown precision(s) {unknown}; valid: {', '.join(BITS)}")
    bits = [BITS[p] for p in out]
    if any(a <= b for a, b in zip(bits, bits[1:])):
        raise ValueError(f"precisions={spec!r}: a cascade runs from the highest precision down, each lower than "
                         f"the one before (e.g. {':'.join(sorted(out, key=lambda p: -BITS[p]))})")
    return out


def percentile_bands(scores, percentile: float, bands: int) -> list[int]:
    """Band of each score: 0 for scores at or above the ``percentile``-th percentile of ``scores``, then
    ``1..bands`` splitting the scores below it evenly by rank (highest first)."""
    import torch

    n = len(scores)
    if n == 0:
        return []
    threshold = torch.quantile(scores, percentile / 100.0) if n > 1 else scores[0]
    out = [0] * n
    below = [i for i in range(n) if scores[i] < threshold]
    below.sort(key=lambda i: -float(scores[i]))
    for r, i in enumerate(below):
        out[i] = 1 + (r * bands) // len(below)
    return out
