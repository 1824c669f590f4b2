from .base import MISS, MissPolicy


@MISS.register("fetch_lowest_bit")
class FetchLowestBit(MissPolicy):
    """Blocking fetch of every miss (and every prefetch) at the lowest stored precision (SpecMD §5.4).
    Under ``quant=none`` that is the native precision, i.e. plain ``fetch``."""

    def setup(self, model):
        self.fetch_precision = model.store.lowest

    def handle(self, layer, missing, record, cache):
        return None
