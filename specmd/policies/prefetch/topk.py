from dataclasses import dataclass

from .base import PREFETCH, PrefetchPolicy, overfetch_count, overfetch_errors, topk_prediction


@dataclass
class TopKParams:
    overfetch: float = 1.0

    def __post_init__(self):
        if self.overfetch <= 0:
            raise ValueError(f"overfetch={self.overfetch} must be > 0")


class TopK(PrefetchPolicy):
    """Speculative next-layer prefetch (Eliseev & Mazur; SpecMD §3.1.4).

    Layer l+1's router is applied to layer l's router input (the post-attention-norm hidden state);
    each token's top ``ceil(k * overfetch)`` experts by router probability are predicted (for
    ``overfetch=1`` exactly the router's own top-k, family selection rules included). Over the
    tokens of the pass the predictions are united and issued in descending order of their highest
    probability (ties: lower expert index first), so the most confident ones reach the channel first.
    """

    name = "topk"

    Params = TopKParams

    @classmethod
    def model_errors(cls, params, model):
        return overfetch_errors(params.overfetch, model)

    def setup(self, model):
        self.count = overfetch_count(self.params.overfetch, model.top_k)

    def predict(self, record, model):
        target = model.next_layer(record.layer)
        if target is None:
            return []
        return [(target, topk_prediction(record, target, self.count))]


PREFETCH.register(TopK)
