from array import array
from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION, EvictionPolicy
from .structures import LayerQueues


def _layer(current, n):  # lowest layer first, whatever the execution point
    return range(n)


def _left_then_right(current, n):  # left of the execution point lowest first, then right furthest ahead first
    return [*range(current + 1), *range(n - 1, current, -1)]


def _needed_last(current, n):  # the layer whose next request comes last first: current, current-1, ..., 0, n-1, ...
    return [*range(current, -1, -1), *range(n - 1, current, -1)]


ORDERS = {"needed_last": _needed_last, "left_then_right": _left_then_right, "layer": _layer, "insertion": None}


STALE, CURRENT = 0, 1  # the two kinds of queue (LayerQueues kinds)


@dataclass
class LeastStaleParams:
    order: str = "needed_last"

    def __post_init__(self):
        check_choice("order", self.order, ORDERS)


class LeastStale(EvictionPolicy):
    """Least-Stale (SpecMD §4.2). An expert is *current* if it was used or prefetched in the ongoing forward
    pass ("used in the current pass or selected by prefetching"), otherwise *stale* ("accessed in a previous
    forward cycle"). Stale experts are evicted before current ones ("Experts in the current queue are evicted
    only to prevent out-of-memory errors"). The order *within* each queue is the ambiguous part; the paper
    says "Within each queue, experts follow FIFO ordering based on layer position", calls an expert *left*
    "if it appears earlier than the current execution point in layer-expert order", and describes the
    effect as "only evicting stale left-layer experts" and "protecting experts needed for upcoming layers".
    ``order`` names the reading (``c`` = the MoE layer executing, ``L`` layers):

    * ``needed_last`` (default): the layer whose next request comes last goes first: ``c, c-1, ..., 0,
      L-1, ..., c+1``. Left layers go before right ones and the next layers' experts go last, as the words
      say; within the left layers the one the pass left *most recently* goes first (Belady's order at layer
      granularity; FLD's ``forward`` distance differs only at the executing layer, which FLD keeps longest).
    * ``left_then_right`` (the text read literally, "FIFO ordering based on layer position"): left experts
      first, lowest layer first (layers ``0..c``: the layer the pass left earliest goes first), then right
      ones furthest ahead first (``L-1`` down to ``c+1``).
    * ``layer``: lowest layer first whatever ``c`` is (a static "layer position" FIFO). Right of ``c`` it
      evicts the next layer's experts first (the ones needed soonest); above one pass's working set it
      hoards the deepest layers.
    * ``insertion``: FIFO by the time the expert joined its queue, ignoring layers.

    Why ``needed_last`` is the default: both it and ``left_then_right`` fit the words (evict left layers
    first, protect the upcoming ones); they differ only in which left layer goes first, so the paper's
    measurements decide (DESIGN.md "Policy readings"). SpecMD reports Least-Stale at 1.6-1.9 % collisions
    against LRU's 4.5-12.6 % at 5 % capacity (Fig. 4/8) and "up to 85x" fewer at 1 %. Below one pass's
    working set every resident expert is current, and ``left_then_right`` (like ``layer`` and
    ``insertion``) is then exactly LRU's order, so it gives LRU's counts where those claims live:
    * real routing (Mixtral-8x7B-Instruct decode, vLLM capture, 577 tokens x 32 layers, one global pool, no
      prefetch; issue 18): collisions at 12 / 25 experts of 256 are LRU 6.3 % / 14.1 %,
      ``left_then_right`` 6.3 % / 14.1 %, ``needed_last`` 0.9 % / 0.9 %;
    * ``deep_olmoe`` (GSM8K decode, ``experiments/README.md``): at 5 % LRU 10.1 %, ``left_then_right``
      10.1 %, ``needed_last`` 2.3 %; at 1 % 2.0 % / 2.0 % / 1.4 %.
    Only ``needed_last`` reproduces the paper's direction, so it is what the paper's implementation did.

    Within one layer the expert that joined the queue first goes first (a key that becomes current again
    moves to the back of the current queue; at a new pass the current queue joins the back of the stale
    one). The executing layer counts as left: its experts that the call did not request are not needed
    again until the next pass (those it requested are pinned by the cache manager). The paper implements
    both queues as priority heaps; here each queue is one FIFO per layer (:class:`~.structures.LayerQueues`, kinds
    stale and current), searched in the reading's layer order: O(L) per victim; a new pass splices each
    layer's current FIFO onto its stale one. Compiled, an extension type (``least_stale.pxd``) whose hooks
    the cache manager calls in C."""

    name = "least_stale"
    Params = LeastStaleParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self._mark = array("q")  # per key: the pass it was last current in (-1: not since it joined)
        self.pass_index = 0
        self.current = 0  # the MoE layer executing
        self._e = 1
        self._flat = self.params.order == "insertion"  # one FIFO per queue instead of one per layer
        self._queues = LayerQueues(1, _layer, 2)

    def attach(self, view, capacity):
        super().attach(view, capacity)
        g = view.geometry
        self._e = g.num_experts
        self._queues = LayerQueues(1 if self._flat else g.num_layers, ORDERS[self.params.order] or _layer, 2)
        self._mark = array("q", [-1]) * (g.num_layers * g.num_experts)

    def on_pass_start(self, pass_index):
        self.pass_index = pass_index
        self._queues.merge(CURRENT, STALE)  # every current key becomes stale

    def on_layer(self, layer, record=None):
        self.current = layer

    def _current(self, key: int):
        if key < 0:
            raise IndexError(f"key {key} < 0")
        if key >= len(self._mark):  # (a policy used without attach: the marks grow to the largest key)
            self._mark = array("q", self._mark) + array("q", [-1]) * (key + 1 - len(self._mark))
        if self._mark[key] != self.pass_index:
            self._mark[key] = self.pass_index
            self._queues.add(0 if self._flat else key // self._e, key, CURRENT)

    def on_insert(self, key: int, prefetch: bool):
        self._current(key)

    def on_access(self, key: int):
        self._current(key)

    def on_remove(self, key: int):
        if key < 0 or key >= len(self._mark):
            raise KeyError(key)
        self._mark[key] = -1
        self._queues.discard(key)

    def victim(self, evictable):
        c = 0 if self._flat else self.current
        key = self._queues.first(c, evictable, STALE)
        return key if key is not None else self._queues.first(c, evictable, CURRENT)


EVICTION.register(LeastStale)
