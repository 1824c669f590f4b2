from dataclasses import dataclass

import numpy as np

from ..base import check_choice
from .base import EVICTION, LazyHeap, OrderedEviction


@EVICTION.register("score")
class Score(OrderedEviction):
    """Score-based eviction (Zhu et al. 2025; SpecMD App. B): evicts the resident expert with the lowest
    mean gate score over a window of recent steps of its layer. Zhu et al. define it for decoding: "for an
    expert i, its score at the j-th token generation during decoding is denoted as S_{i,j}", and the victim
    is argmin_i of the mean of S_{i,k} over k = max(1, j-n)..j (Eq. 3); "the activation scores of all
    experts accessed within the observation window" count, selected or not. Readings:

    * ``unit``: what one step of the window is. ``token`` (default, Eq. 3's S_{i,j} is per generated
      token): every token of a layer call is one step, so a prefill call of T tokens pushes its last
      min(T, n) tokens' router probabilities. ``call``: one layer call is one step, scored by its
      probabilities averaged over its tokens (a prefill pass counts as one step). They agree in decoding
      (one token per call).
    * ``n``: the window length in steps, the current one included. Eq. 3 sums n+1 terms (k = j-n..j) while
      the text says "the preceding n iterations"; ``n`` here is the number of terms (Eq. 3 literally is
      ``n`` = its n + 1).

    The score of an expert at a step is its router probability (every expert of the layer gets one);
    experts of a layer not yet seen score 0. The protection shield ("the system dynamically elevates the
    eviction priority of any expert selected by the expert router for computation in a layer"): the
    running layer's experts are never evicted while it computes (the cache manager's pinning). Ties: lower
    key first.

    The ranking lives in a min-heap of ``(score, key)`` entries with lazy invalidation
    (:class:`~.base.LazyHeap`; an entry is live while it is its resident key's newest one, ``_entry[key]``);
    a layer call that changes a layer's means pushes a new entry for each of that layer's resident keys
    whose score changed."""

    @dataclass
    class Params:
        n: int = 8
        unit: str = "token"

        def __post_init__(self):
            if self.n < 1:
                raise ValueError(f"n={self.n} must be >= 1")
            check_choice("unit", self.unit, ("token", "call"))

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.history: dict[int, np.ndarray] = {}  # layer -> its window, [steps <= n, E] float64
        self.mean: dict[int, np.ndarray] = {}
        self._entry: dict[int, tuple[float, int]] = {}  # resident key -> its live heap entry (score, key)
        self._by_layer: dict[int, set[int]] = {}  # layer -> its resident keys
        self._means: dict[int, list[float]] = {}  # layer -> mean[layer] as Python floats
        self._heap = LazyHeap()

    def _push(self, key, score) -> None:
        ent = self._entry[key] = (score, key)
        heap = self._heap
        heap.push(ent)
        if len(heap) > 2 * len(self._entry) + 64:  # mostly dead entries: rebuild from the live ones
            self._heap = LazyHeap(self._entry.values())

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        layer, expert = divmod(key, self.keys.num_experts)
        self._by_layer.setdefault(layer, set()).add(key)
        m = self._means.get(layer)
        self._push(key, 0.0 if m is None else m[expert])

    def on_remove(self, key):
        super().on_remove(key)
        del self._entry[key]
        self._by_layer[key // self.keys.num_experts].discard(key)

    def on_layer(self, layer, record=None):
        if record is None:
            return
        probs = record.probs
        steps = (probs[-self.params.n:] if self.params.unit == "token" else probs.mean(0, keepdim=True))
        steps = steps.double().cpu().numpy()  # [steps, E]
        hist = self.history.get(layer)
        hist = self.history[layer] = steps if hist is None else np.concatenate([hist, steps])[-self.params.n:]
        self.mean[layer] = hist.sum(0) / len(hist)
        m = self._means[layer] = self.mean[layer].tolist()
        keys = self._by_layer.get(layer)
        if keys:
            base, entry, push = layer * self.keys.num_experts, self._entry, self._push
            for k in keys:
                s = m[k - base]
                if s != entry[k][0]:
                    push(k, s)

    def victim(self, evictable):
        ent = self._heap.first(evictable, self._entry)
        return None if ent is None else ent[1]
