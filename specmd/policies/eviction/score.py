from dataclasses import dataclass

import numpy as np

from ...engine.record import NoLogits
from ..base import check_choice
from .base import EVICTION, LazyHeap, OrderedEviction


START = ("mean", "zero")


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

    * ``start``: the score of an expert that joins the cache (a demand fetch or a prefetch) before its
      layer's next step. ``mean`` (default): its layer's current window mean (its history exists whether or
      not it was resident: "the activation scores of all experts ... within the observation window");
      ``zero``: no history until its layer runs again, so a prefetched expert of an upcoming layer is the
      first victim (a naive implementation's artefact, and the mechanism SpecMD §5.2 blames: "experts from
      future layers get evicted prematurely").
    * ``value``: what a score is. ``probs`` (default, Zhu et al.'s "gate score", the router probability);
      ``logits``: the raw router logit (SpecMD §3.1.3 calls SB's signal "gate's logits"). Softmax ignores a
      per-layer shift of the logits, so across layers raw logits rank experts arbitrarily.

    Evidence (issue 18). SpecMD reports SB "catastrophic" at 5 %: 42.6-60.9 % collisions where LRU has
    4.5-12.6 % and Least-Stale 1.6-1.9 %, because "a highly-scored expert from layer 2 gets retained over a
    lower-scored expert from layer 10". No reading here reproduces that; every combination stays among the
    best policies. Collision rate % / hit rate % replaying ``deep_olmoe``'s GSM8K recording (the
    ``specmd_fig4`` trace, 320 passes, one global pool) at 1 / 5 / 25 %:

    ============================  =====================  =====================  =====================
    reading (prefetch=none)       1 %                    5 %                    25 %
    ============================  =====================  =====================  =====================
    LRU                           2.0 / 0.0              10.1 / 0.0             9.6 / 33.4
    SB default (mean, probs)      1.5 / 0.5              2.5 / 7.5              1.7 / 40.4
    SB ``start=zero``             1.4 / 0.3              2.4 / 4.0              2.4 / 25.8
    SB ``value=logits``           1.5 / 0.6              2.6 / 8.0              2.0 / 39.6
    SB zero + logits              1.4 / 0.4              2.3 / 5.0              2.1 / 32.3
    ============================  =====================  =====================  =====================

    With ``prefetch=topk`` or ``prefetch=score`` (the paper's Fig. 4 runs with prefetching) every SB reading
    stays at 1.0-1.3 % at 5 %, LRU at 1.0-1.6 %. On real Mixtral-8x7B routing the default SB has 1.5 %
    against LRU's 6.3 % (12 experts of 256, no prefetch). A collision needs an expert resident during the
    pass and evicted before its layer runs; an SB victim is the lowest score over *all* layers, and the
    experts an upcoming layer will request scored high at its last step, so SB rarely picks them under any
    scoring. What does produce collisions of that size is a policy that may evict the *running call's own*
    experts (no protection shield: each fetch of the call evicting the previous one, itself at score 0);
    Zhu et al. have the shield ("to prevent evicting an expert immediately before its use"), and the cache
    manager pins a running call's experts for every policy, so that reading is not offered. The defaults
    stay Zhu et al.'s definitions. ``score`` with ``start=zero``/``value=logits`` reproduces the ablation.

    The score of an expert at a step is its router probability (or logit, ``value=logits``; every expert of
    the layer gets one); experts of a layer not yet seen score 0. The protection shield ("the system dynamically elevates the
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
        start: str = "mean"
        value: str = "probs"

        def __post_init__(self):
            if self.n < 1:
                raise ValueError(f"n={self.n} must be >= 1")
            check_choice("unit", self.unit, ("token", "call"))
            check_choice("start", self.start, START)
            check_choice("value", self.value, ("probs", "logits"))

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.history: dict[int, np.ndarray] = {}  # layer -> its window, [steps <= n, E] float64
        self.mean: dict[int, np.ndarray] = {}
        self._entry: dict[int, tuple[float, int]] = {}  # resident key -> its live heap entry (score, key)
        self._by_layer: dict[int, set[int]] = {}  # layer -> its resident keys
        self._means: dict[int, list[float]] = {}  # layer -> mean[layer] as Python floats
        self._heap = LazyHeap()
        self._zero = self.params.start == "zero"

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        layer, expert = divmod(key, self.keys.num_experts)
        self._by_layer.setdefault(layer, set()).add(key)
        m = self._means.get(layer)
        self._heap.put(self._entry, (0.0 if m is None or self._zero else m[expert], key))

    def on_remove(self, key):
        super().on_remove(key)
        del self._entry[key]
        self._by_layer[key // self.keys.num_experts].discard(key)

    def on_layer(self, layer, record=None):
        if record is None:
            return
        probs = record.probs if self.params.value == "probs" else record.logits
        if probs is None:
            raise NoLogits("eviction=score eviction.value=logits needs router logits, and this layer call has none "
                           "(the trace did not record them: record it with trace.logits=fp32 or fp16)")
        steps = (probs[-self.params.n:] if self.params.unit == "token" else probs.mean(0, keepdim=True))
        steps = steps.float().cpu().numpy().astype(np.float64)  # [steps, E]: exact (= .double(), without a torch op)
        hist = self.history.get(layer)
        hist = self.history[layer] = steps if hist is None else np.concatenate([hist, steps])[-self.params.n:]
        self.mean[layer] = hist.sum(0) / len(hist)
        m = self._means[layer] = self.mean[layer].tolist()
        keys = self._by_layer.get(layer)
        if keys:
            base, entry, put = layer * self.keys.num_experts, self._entry, self._heap.put
            for k in keys:
                s = m[k - base]
                if s != entry[k][0]:
                    put(entry, (s, k))

    def victim(self, evictable):
        ent = self._heap.first(evictable, self._entry)
        return None if ent is None else ent[1]
