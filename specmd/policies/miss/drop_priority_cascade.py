from dataclasses import dataclass

from .base import MISS, CascadeMissPolicy, CascadeParams, Dropped, Fetched, best_ranks, expert_scores, percentile_bands


@dataclass
class DropPriorityCascadeParams(CascadeParams):
    J: int = 1


class DropPriorityCascade(CascadeMissPolicy):
    """Drop Priority Cascade (SpecMD §5.4): a miss ranked in some token's top ``J`` is fetched at the highest
    precision of ``precisions``; the others are banded by gate score (the selection score, ``expert_scores``)
    among this layer call's requested experts: at or above the ``percentile``-th percentile -> highest precision, below it split evenly over
    the lower precisions and one final band that is dropped (``int8:4:2``: int4, int2, drop)."""

    name = "drop_priority_cascade"

    Params = DropPriorityCascadeParams

    def handle(self, layer, missing, record, cache):
        requested = record.index.unique().tolist()
        cascade = self.params.cascade
        bands = percentile_bands(expert_scores(record, requested), self.params.percentile, len(cascade))
        band = dict(zip(requested, bands))
        ranks = best_ranks(record, missing)
        out = []
        for e, r in zip(missing, ranks):
            b = 0 if r < self.params.J else band[e]
            out.append(Dropped() if b >= len(cascade) else Fetched(cascade[b]))
        return out


MISS.register(DropPriorityCascade)
