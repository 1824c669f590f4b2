from dataclasses import dataclass

import numpy as np

from ...engine.record import NoLogits
from ..base import check_choice, memory_errors
from .base import EVICTION, EvictionPolicy
from .structures import KeyHeap


START = ("mean", "zero")


@dataclass
class ScoreParams:
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


class ScoreEviction(EvictionPolicy):
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
    the layer gets one); experts of a layer not yet seen score 0. The protection shield ("the system
    dynamically elevates the eviction priority of any expert selected by the expert router for computation
    in a layer"): the running layer's experts are never evicted while it computes (the cache manager's
    pinning). Ties: lower key first.

    The window of each layer is a ring of its last ``n`` steps ([L, n, E] doubles), and a step re-sums its
    layer's window oldest step first (the order and the bits of numpy's ``window.sum(0) / len(window)``,
    tested) into the layer's means. The residents are ranked by ``(score, key)`` in a
    :class:`~.structures.KeyHeap` (``set_score``): a step re-ranks its layer's resident keys in place. The
    token steps are read from :meth:`GateRecord.probs_rows <specmd.engine.record.GateRecord.probs_rows>`,
    which a replay answers from probabilities computed a chunk of calls at a time. No allocation per
    step. (Compiled, an extension type, ``score.pxd``.)"""

    reads_logits = True  # its window holds router probabilities

    name = "score"
    Params = ScoreParams  # (module-level: an extension type's body holds no class statement)

    @classmethod
    def model_errors(cls, params, model):
        # per pool: the [L, n, E] float64 ring of every layer's last n steps
        return memory_errors(f"n={params.n}", 8 * model.num_layers * params.n * model.num_experts)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self.n = self.params.n
        self._token = self.params.unit == "token"
        self._probs = self.params.value == "probs"
        self._zero = self.params.start == "zero"
        self._heap = KeyHeap()  # the resident keys by (score, key)
        self._shape(0, 0)

    def _shape(self, layers: int, experts: int):
        self.E = experts
        self._win = np.zeros((max(layers, 1), self.n, max(experts, 1)))  # layer -> its last n steps (a ring)
        self._mean = np.zeros((max(layers, 1), max(experts, 1)))  # layer -> its window's mean per expert
        self._len = np.zeros(max(layers, 1), dtype=np.int64)  # layer -> steps in its window (0: never seen)
        self._next = np.zeros(max(layers, 1), dtype=np.int64)  # layer -> the ring slot its next step fills

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self._shape(view.geometry.num_layers, view.geometry.num_experts)

    @property
    def history(self) -> dict:
        """Each seen layer's window, oldest step first ([steps, E] arrays; new: for checks and tests)."""
        win, out = np.asarray(self._win), {}
        for layer in range(len(self._len)):
            k = int(self._len[layer])
            if k:
                out[layer] = win[layer, [(int(self._next[layer]) - k + j) % self.n for j in range(k)]]
        return out

    @property
    def mean(self) -> dict:
        """Each seen layer's window mean ([E] arrays; new: for checks and tests)."""
        return {layer: np.array(self._mean[layer]) for layer in range(len(self._len)) if self._len[layer]}

    def on_layer(self, layer, record=None):
        if record is None:
            return
        if self._token and self._probs:
            steps = record.probs_rows()
        else:
            if self._probs:
                scores = record.probs
            else:
                try:
                    scores = record.logits
                except NoLogits as e:
                    raise NoLogits(f"eviction=score eviction.value=logits needs router logits: {e}") from None
                if scores is None:
                    raise NoLogits("eviction=score eviction.value=logits needs router logits, and this layer call "
                                   "has none (the trace did not record them: record it with trace.logits=fp32 "
                                   "or fp16)")
            steps = (scores[-self.n:] if self._token else scores.mean(0, keepdim=True)).float().cpu().numpy()
        if steps.shape[1] > self.E:  # identity experts' columns (LongCat-Flash's): none of them is cached
            steps = np.ascontiguousarray(steps[:, :self.E])
        self._step(layer, steps)

    def _step(self, layer: int, steps: memoryview):
        """Push the last ``n`` rows of ``steps`` ([T, E] float32) into ``layer``'s window, re-sum it, and
        re-rank the layer's resident keys."""
        E = self.E
        n = self.n
        if steps.shape[1] != E:
            raise ValueError(f"eviction=score: a layer call of {steps.shape[1]} experts' scores; the model has {E}")
        if not 0 <= layer < self._len.shape[0]:
            raise IndexError(f"eviction=score: MoE layer {layer} outside the model's {self._len.shape[0]}")
        self._fill(layer, steps)
        self._rerank(layer)

    def _fill(self, layer: int, steps: memoryview):
        n = self.n
        T = steps.shape[0]
        win = self._win
        for t in range(max(T - n, 0), T):
            slot = self._next[layer]
            for e in range(self.E):
                win[layer, slot, e] = steps[t, e]
            self._next[layer] = slot + 1 if slot + 1 < n else 0
            if self._len[layer] < n:
                self._len[layer] += 1

    def _rerank(self, layer: int):
        n = self.n
        E = self.E
        k = self._len[layer]
        slot = self._next[layer] - k
        if slot < 0:
            slot += n
        win = self._win
        mean = self._mean
        for e in range(E):  # the sums run oldest step first, each expert's in numpy's order
            mean[layer, e] = win[layer, slot, e]
        for j in range(1, k):
            slot = slot + 1 if slot + 1 < n else 0
            for e in range(E):
                mean[layer, e] += win[layer, slot, e]
        base = layer * E
        heap: KeyHeap = self._heap
        for e in range(E):
            mean[layer, e] = mean[layer, e] / k
            if heap.contains(base + e):
                heap.set_score(base + e, mean[layer, e])

    def on_insert(self, key: int, prefetch: bool):
        layer = key // self.E
        if layer < 0 or layer >= self._len.shape[0]:
            raise IndexError(f"eviction=score: key {key} outside the model's {self._len.shape[0]} layers")
        s = 0.0
        if self._len[layer] > 0 and not self._zero:
            s = self._mean[layer, key - layer * self.E]
        self._heap.set_score(key, s)

    def on_access(self, key: int):
        pass

    def on_remove(self, key: int):
        self._heap.remove(key)

    def victim(self, evictable):
        return self._heap.first(evictable)


EVICTION.register(ScoreEviction)
