from .base import QUANT, ExpertStore, QuantMethod


class NoQuant(QuantMethod):
    """Experts only at the model's own dtype (``native``): every fetch is lossless."""

    name = "none"

    def build(self, experts, num_experts, tag):
        mod = experts[0]
        nbytes = sum(p.numel() * p.element_size() for p in mod.parameters()) // num_experts
        bits = next(mod.parameters()).element_size() * 8
        return ExpertStore(bits, nbytes, {})


QUANT.register(NoQuant)
