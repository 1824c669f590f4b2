from .base import MISS, MissPolicy


@MISS.register("fetch")
class Fetch(MissPolicy):
    """Blocking fetch of every miss at full (stored) precision: 100% fidelity, pays the transfer stall."""

    def handle(self, layer, missing, record, cache):
        return None
