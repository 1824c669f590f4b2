from ...errors import ConfigError
from .base import PREFETCH, PrefetchPolicy


class Oracle(PrefetchPolicy):
    """Oracle prefetch: exactly the next MoE layer's true request set, issued in ascending expert order
    when the current layer's experts start (the upper bound of any next-layer predictor: precision and
    recall 1). Replay only: it reads the recorded future (the router's own requests of the next layer call
    of the same forward pass); a live run is rejected before the model loads."""

    name = "oracle"

    needs_future = True

    @classmethod
    def signal_depth(cls, params):
        return 0

    def setup(self, model):
        if model.future is None:
            raise ConfigError("prefetch=oracle needs the future: replay a trace (replay.trace=PATH)")
        self.future = model.future

    def predict(self, record, model):
        target = model.next_layer(record.layer)
        nxt = record.call + 1
        if target is None or self.future.layer_of(nxt) != target:
            return []
        return [(target, self.future.requests(nxt))]


PREFETCH.register(Oracle)
