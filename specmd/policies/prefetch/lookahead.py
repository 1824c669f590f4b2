from dataclasses import dataclass

from .base import PREFETCH, PrefetchPolicy, overfetch_count, overfetch_errors, topk_prediction


@dataclass
class LookaheadParams:
    depth: int = 2
    overfetch: float = 1.0

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"depth={self.depth} must be >= 1")
        if self.overfetch <= 0:
            raise ValueError(f"overfetch={self.overfetch} must be > 0")


class Lookahead(PrefetchPolicy):
    """Multi-layer lookahead (HOBBIT, Tang et al. 2024): gating inputs of adjacent layers are similar, so
    the routers of layers l+1 ... l+``depth`` are all applied to layer l's router input and each token's top
    ``ceil(k * overfetch)`` experts of each are prefetched, nearer layers first (the channel is FIFO, so
    layer l+1's predictions arrive first). A layer predicted from several earlier layers is requested again
    each time; experts already resident or in flight are not re-fetched."""

    name = "lookahead"

    Params = LookaheadParams

    @classmethod
    def signal_depth(cls, params):
        return params.depth

    @classmethod
    def model_errors(cls, params, model):
        errors = overfetch_errors(params.overfetch, model)
        if params.depth > model.num_layers - 1:  # the last layer has no later one to predict
            errors.append(f"depth={params.depth} looks past the model's last MoE layer: it has {model.num_layers}, "
                          f"so at most {model.num_layers - 1} later layers")
        return errors

    def setup(self, model):
        self.count = overfetch_count(self.params.overfetch, model.top_k)
        self.num_layers = model.num_layers

    def predict(self, record, model):
        out = []
        for d in range(1, self.params.depth + 1):
            target = record.layer + d
            if target >= self.num_layers:
                break
            out.append((target, topk_prediction(record, target, self.count)))
        return out


PREFETCH.register(Lookahead)
