from .base import PREFETCH, PrefetchPolicy


@PREFETCH.register("none")
class NoPrefetch(PrefetchPolicy):
    """No prefetching: every expert arrives by a demand fetch."""

    def predict(self, record, model):
        return []
