from .base import PREFETCH, PrefetchPolicy


class NoPrefetch(PrefetchPolicy):
    """No prefetching: every expert arrives by a demand fetch."""

    name = "none"

    @classmethod
    def signal_depth(cls, params):
        return 0

    def predict(self, record, model):
        return []

    def passive(self):
        return type(self).predict is NoPrefetch.predict  # (a subclass with its own predict is called)


PREFETCH.register(NoPrefetch)
