from .base import MISS, CascadeMissPolicy, Fetched, expert_scores, percentile_bands


class FetchPriority(CascadeMissPolicy):
    """Fetch Priority (SpecMD §5.4; HOBBIT's precision cascade): misses whose gate score is at or above the
    ``percentile``-th percentile of this layer call's requested experts are fetched at the first (highest)
    precision of ``precisions``; those below are degraded, split evenly by score rank over the remaining
    precisions (``int8:4:2``: upper half of the degraded -> int4, lower half -> int2). A score is the
    expert's highest selection score over the tokens that selected it (``expert_scores``: its router
    probability, plus the family's selection bias where the router has one, so the bands follow the router's
    own ranking). Prefetches use the highest."""

    name = "fetch_priority"

    def handle(self, layer, missing, record, cache):
        requested = record.index.unique().tolist()
        scores = expert_scores(record, requested)
        cascade = self.params.cascade
        bands = percentile_bands(scores, self.params.percentile, max(1, len(cascade) - 1))
        band = dict(zip(requested, bands))
        return [Fetched(cascade[min(band[e], len(cascade) - 1)]) for e in missing]


MISS.register(FetchPriority)
