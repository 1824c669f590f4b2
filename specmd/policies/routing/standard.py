from .base import ROUTING, RoutingPolicy


class Standard(RoutingPolicy):
    """Unmodified routing: the router's own top-k (100% routing fidelity)."""

    name = "standard"

    reads_logits = False  # (Policy.reads_logits)

    def apply(self, record, cache):
        return None

    def passive(self):
        return type(self).apply is Standard.apply  # (a subclass with its own apply is called)


ROUTING.register(Standard)
