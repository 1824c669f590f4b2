from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION, EvictionPolicy
from .structures import LayerQueues


def _forward(current, n):  # distance (layer - current) mod n, furthest first; the current layer last
    return sorted(range(n), key=lambda l: -((l - current) % n))


def _absolute(current, n):  # |layer - current|, furthest first; ties: the left layer (already executed) first
    return sorted(range(n), key=lambda l: (-abs(l - current), l))


DISTANCES = {"absolute": _absolute, "forward": _forward}


@dataclass
class FLDParams:
    distance: str = "absolute"

    def __post_init__(self):
        check_choice("distance", self.distance, DISTANCES)


class FLD(EvictionPolicy):
    """Furthest Layer Distance (HOBBIT, Tang et al. 2024; SpecMD App. B): evicts an expert of the layer
    furthest from the layer executing. SpecMD's description: "This policy computes the distance between
    each cached expert's layer and the current inference layer, evicting experts from the farthest layers
    first." ``distance`` names the reading (``c`` = the layer executing, ``L`` layers):

    * ``absolute`` (default, the paper's words: a plain distance between two layers): ``|layer - c|``.
      Layers ``c-d`` and ``c+d`` tie; the left one goes first (it has executed in this pass and is not
      needed before the next one, the right one is needed later in this pass). This is a *spatial-only*
      policy, as SpecMD classes FLD, and SpecMD finds it "only slightly better than LRU".
    * ``forward``: ``(layer - c) mod L``, the distance execution still has to travel to reach the layer
      (after the executing layer, the next layer, distance 1, is kept longest; the layer just executed,
      distance L-1, goes first).
      This reading is close to Belady's order at layer granularity and is a much stronger baseline.

    The executing layer has distance 0 in both and goes last. Ties within a layer: the expert resident
    longest (insertion order). Each layer keeps its resident keys in insertion order
    (:class:`~.structures.LayerQueues`); a victim costs O(L), not O(pool). Compiled, an extension type
    (``fld.pxd``) whose hooks the cache manager calls in C."""

    name = "fld"
    Params = FLDParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self.current = 0
        self._e = 1
        self._queues = LayerQueues(1, DISTANCES[self.params.distance])

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self._e = view.geometry.num_experts
        self._queues = LayerQueues(view.geometry.num_layers, DISTANCES[self.params.distance])

    def on_layer(self, layer, record=None):
        self.current = layer

    def on_insert(self, key: int, prefetch: bool):
        self._queues.add(key // self._e, key)

    def on_access(self, key: int):
        pass

    def on_remove(self, key: int):
        self._queues.discard(key)

    def victim(self, evictable):
        return self._queues.first(self.current, evictable)


EVICTION.register(FLD)
