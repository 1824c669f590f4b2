from .base import EVICTION, OrderedEviction, argmin_key


@EVICTION.register("fld")
class FLD(OrderedEviction):
    """Furthest Layer Distance (HOBBIT, Tang et al. 2024; SpecMD App. B): evicts the expert whose layer is
    furthest from the current layer *in forward order*: distance = (expert_layer - current) mod L, so the
    next layer's experts (distance 1) are kept longest and the layer just executed (distance L-1, not needed
    until the next pass) goes first. Ties (same layer): the one resident longest (insertion order)."""

    def __init__(self, params=None):
        super().__init__(params)
        self.current = 0
        self.num_layers = 1

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.num_layers = view.geometry.num_layers

    def on_layer(self, layer, record=None):
        self.current = layer

    def victim(self, evictable):
        e, cur, n = self.keys.num_experts, self.current, self.num_layers
        return argmin_key(self._order, evictable, lambda k: -((k // e - cur) % n))
