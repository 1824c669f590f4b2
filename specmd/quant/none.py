from .base import QUANT, ExpertStore, QuantMethod


class NoQuant(QuantMethod):
    """Experts only at the model's own dtype (``native``): every fetch is lossless."""

    name = "none"

    def build(self, experts, num_experts, tag):
        from ..executor.kernel import expert_tensors

        mod = experts[0]  # (an expert: the module's [E, ...] tensors; a norm the experts share is dense)
        nbytes = sum(p.numel() * p.element_size() for p in expert_tensors(mod, num_experts).values()) // num_experts
        bits = next(mod.parameters()).element_size() * 8
        return ExpertStore(bits, nbytes, {})


QUANT.register(NoQuant)
