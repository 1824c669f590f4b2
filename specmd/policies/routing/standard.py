from .base import ROUTING, RoutingPolicy


class Standard(RoutingPolicy):
    """Unmodified routing: the router's own top-k (100% routing fidelity)."""

    name = "standard"

    reads_logits = False  # (Policy.reads_logits)

    def apply(self, record, cache):
        return None

    def passive(self):
        # (a subclass with its own apply, or its own route, is called)
        return type(self).apply is Standard.apply and type(self).route is RoutingPolicy.route


ROUTING.register(Standard)
