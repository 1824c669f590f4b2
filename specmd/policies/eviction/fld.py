from collections import OrderedDict

from .base import EVICTION, OrderedEviction


@EVICTION.register("fld")
class FLD(OrderedEviction):
    """Furthest Layer Distance (HOBBIT, Tang et al. 2024; SpecMD App. B): evicts the expert whose layer is
    furthest from the current layer *in forward order*: distance = (expert_layer - current) mod L, so the
    next layer's experts (distance 1) are kept longest and the layer just executed (distance L-1, not needed
    until the next pass) goes first. Ties (same layer): the one resident longest (insertion order).

    Each layer keeps its resident keys in insertion order (one FIFO per layer); a victim is the first
    evictable key of the furthest non-empty layer: O(L) per eviction, not O(pool)."""

    def __init__(self, params=None):
        super().__init__(params)
        self.current = 0
        self.num_layers = 1
        self._fifo: list[OrderedDict] = [OrderedDict()]  # per layer: its resident keys, insertion order
        self._scan: list[OrderedDict] = []  # the FIFOs, furthest layer first (cached per current layer)
        self._scan_for = None

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.num_layers = view.geometry.num_layers
        self._fifo = [OrderedDict() for _ in range(self.num_layers)]
        self._scan_for = None

    def on_layer(self, layer, record=None):
        self.current = layer

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        self._fifo[key // self.keys.num_experts][key] = None

    def on_remove(self, key):
        super().on_remove(key)
        del self._fifo[key // self.keys.num_experts][key]

    def victim(self, evictable):
        if self._scan_for != self.current:
            cur, n = self.current, self.num_layers
            # distance (layer - cur) % n from n - 1 down to 0; equal distances cannot occur (layer < n)
            self._scan = [self._fifo[l] for l in sorted(range(n), key=lambda l: -((l - cur) % n))]
            self._scan_for = self.current
        for fifo in self._scan:
            if fifo:
                for key in fifo:
                    if evictable(key):
                        return key
        return None
