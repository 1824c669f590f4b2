from collections import deque
from dataclasses import dataclass

import numpy as np

from .base import EVICTION, LazyHeap, OrderedEviction


@EVICTION.register("score")
class Score(OrderedEviction):
    """Score-based eviction (Zhu et al. 2025; SpecMD App. B): evicts the resident expert with the lowest
    mean gate score over the last ``n`` calls of its layer (decode steps; a prefill pass counts as one
    step, scored by its mean over tokens). The score of an expert at a step is its router probability
    averaged over the step's tokens (every expert of the layer gets one, selected or not); experts of a
    layer not yet seen score 0. The protection shield: the running layer's experts are never evicted
    while it computes (the cache manager's pinning). Ties: lower key first.

    The ranking lives in a min-heap of ``(score, key)`` entries with lazy invalidation
    (:class:`~.base.LazyHeap`; an entry is live while it is its resident key's newest one, ``_entry[key]``);
    a layer call that changes a layer's means pushes a new entry for each of that layer's resident keys
    whose score changed."""

    @dataclass
    class Params:
        n: int = 8

        def __post_init__(self):
            if self.n < 1:
                raise ValueError(f"n={self.n} must be >= 1")

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.history: dict[int, deque] = {}
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
        scores = record.probs.mean(0).double().cpu().numpy()
        hist = self.history.setdefault(layer, deque())
        hist.append(scores)
        if len(hist) > self.params.n:
            hist.popleft()
        self.mean[layer] = sum(hist) / len(hist)
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
