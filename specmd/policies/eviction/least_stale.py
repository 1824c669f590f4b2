from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION, EvictionPolicy, LayerQueues


def _layer(current, n):  # lowest layer first, whatever the execution point
    return range(n)


def _left_then_right(current, n):  # left of the execution point lowest first, then right furthest ahead first
    return [*range(current + 1), *range(n - 1, current, -1)]


def _needed_last(current, n):  # the layer whose next request comes last first: current, current-1, ..., 0, n-1, ...
    return [*range(current, -1, -1), *range(n - 1, current, -1)]


ORDERS = {"left_then_right": _left_then_right, "layer": _layer, "needed_last": _needed_last, "insertion": None}


@EVICTION.register("least_stale")
class LeastStale(EvictionPolicy):
    """Least-Stale (SpecMD §4.2). An expert is *current* if it was used or prefetched in the ongoing forward
    pass ("used in the current pass or selected by prefetching"), otherwise *stale* ("accessed in a previous
    forward cycle"). Stale experts are evicted before current ones ("Experts in the current queue are evicted
    only to prevent out-of-memory errors"). The order *within* each queue is the ambiguous part; the paper
    says "Within each queue, experts follow FIFO ordering based on layer position", calls an expert *left*
    "if it appears earlier than the current execution point in layer-expert order", and describes the
    effect as "only evicting stale left-layer experts" and "protecting experts needed for upcoming layers".
    ``order`` names the reading (``c`` = the MoE layer executing, ``L`` layers):

    * ``left_then_right`` (default, the paper's words): left experts first (layers ``0..c``, lowest layer
      first: FIFO by layer position, the layer the pass left earliest goes first), then right ones furthest
      ahead first (layers ``L-1`` down to ``c+1``), so the next layers' experts are evicted last. The
      executing layer counts as left: its experts that the call did not request are not needed again until
      the next pass (those it requested are pinned by the cache manager).
    * ``layer``: lowest layer first whatever ``c`` is (a static "layer position" FIFO). Below one pass's
      working set this gives LRU's counts exactly, and right of ``c`` it evicts the next layer's experts
      first (the ones needed soonest); above it, it hoards the deepest layers.
    * ``needed_last``: the layer whose next request comes last goes first: ``c, c-1, ..., 0, L-1, ..., c+1``
      (Belady's order at layer granularity; FLD's forward distance differs only at the executing layer,
      which FLD keeps longest).
    * ``insertion``: FIFO by the time the expert joined its queue, ignoring layers.

    Within one layer the expert that joined the queue first goes first (a key that becomes current again
    moves to the back of the current queue; at a new pass the current queue joins the back of the stale
    one). The paper implements both queues as priority heaps; here each queue is one FIFO per layer
    (:class:`~.base.LayerQueues`), searched in the reading's layer order: O(L) per victim."""

    @dataclass
    class Params:
        order: str = "left_then_right"

        def __post_init__(self):
            check_choice("order", self.order, ORDERS)

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.mark: dict[int, int] = {}  # key -> the pass it was last current in
        self.pass_index = 0
        self.current = 0  # the MoE layer executing
        self._e = 1
        self._flat = self.params.order == "insertion"  # one FIFO per queue instead of one per layer
        self._stale = self._cur = LayerQueues(1, _layer)

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self._e = view.geometry.num_experts
        order = ORDERS[self.params.order] or _layer
        n = 1 if self._flat else view.geometry.num_layers
        self._stale, self._cur = LayerQueues(n, order), LayerQueues(n, order)

    def on_pass_start(self, pass_index):
        self.pass_index = pass_index
        for stale, cur in zip(self._stale.fifo, self._cur.fifo):  # every current key becomes stale
            if cur:
                stale.update(cur)
                cur.clear()

    def on_layer(self, layer, record=None):
        self.current = layer

    def _current(self, key):
        p = self.pass_index
        if self.mark.get(key) != p:
            self.mark[key] = p
            layer = 0 if self._flat else key // self._e
            self._stale.discard(layer, key)
            self._cur.add(layer, key)

    def on_insert(self, key, prefetch):
        self._current(key)

    def on_access(self, key):
        self._current(key)

    def on_remove(self, key):
        del self.mark[key]
        layer = 0 if self._flat else key // self._e
        self._stale.discard(layer, key)
        self._cur.discard(layer, key)

    def victim(self, evictable):
        c = 0 if self._flat else self.current
        key = self._stale.first(c, evictable)
        return key if key is not None else self._cur.first(c, evictable)
