# cython: wraparound=False
# (the merge and selection loops below index buffers from 0 up: no index wraps)
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..base import check_choice, memory_errors
from .base import PREFETCH, PrefetchPolicy, union_by_score


@dataclass
class ScorePrefetchParams:
    percentile: float = 80.0
    window: int = 64
    basis: str = "window"

    def __post_init__(self):
        if not 0.0 <= self.percentile < 100.0:
            raise ValueError(f"percentile={self.percentile} must be in [0, 100)")
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        check_choice("basis", self.basis, ("window", "token"))


class ScorePrefetch(PrefetchPolicy):
    """Score-based prefetch (Zhu et al. 2025; SpecMD §3.1.4): the next layer's router is applied to the
    current router input and every expert whose predicted probability is at or above the ``percentile``-th
    percentile is prefetched. SpecMD: it "filters experts by softmax score rather than fixed top-k count
    and prefetch all experts above a configurable percentile threshold (the default is 80th percentile).
    Unlike top-k approaches, this method adapts the number of prefetched experts based on score
    distribution." The papers do not say over which scores the percentile is taken (``basis``):

    * ``window`` (default): over a window of the target layer's recent predicted scores (all experts of the
      last ``window`` predictions, the current one included). A confident prediction (a few high scores)
      prefetches few experts, a flat one fewer still, and a layer's threshold adapts to how peaked its
      router is: the count adapts, as the text says.
    * ``token``: over each token's own E scores. Then every token prefetches a fixed (100 - percentile)%
      of the experts (ties aside), which is top-k with k = (1 - percentile/100)·E: the count does *not*
      adapt, contradicting the text; kept as the literal "percentile of the softmax scores" reading."""

    name = "score"

    Params = ScorePrefetchParams

    @classmethod
    def model_errors(cls, params, model):
        # per target layer: the ring, its sorted copy and a spare, [window, E] float32 each
        return memory_errors(f"window={params.window}", 3 * 4 * params.window * model.num_experts * model.num_layers)

    def setup(self, model):
        L = model.num_layers
        self.ring: list = [None] * L  # target layer -> [window, E] scores of its last predictions
        self.pos = [0] * L  # next row to overwrite
        self.filled = [0] * L  # rows holding scores (< window until the ring wraps)
        self._sorted: list = [None] * L  # target layer -> its ring's filled scores, ascending (a [window * E] buffer)
        self._spare: list = [None] * L  # ... and the buffer the next merge writes
        self._points: list = [None] * L  # target layer -> (count, lo, hi, w): the quantile's points for its size
        self._best = np.empty(0, dtype=np.float32)  # per expert: the best selected score (scratch)
        self._order = np.empty(0, dtype=np.int64)  # the selected experts (scratch)

    @property
    def sorted(self) -> list:
        """Each target layer's window, ascending (new arrays, for checks and tests; None before its first
        prediction)."""
        return [None if ring is None else np.array(self._sorted[t][:self.filled[t] * ring.shape[1]])
                for t, ring in enumerate(self.ring)]

    def _push(self, target: int, rows: np.ndarray) -> None:
        """The target layer's ring takes ``rows`` ([T, E] float32, the current prediction), keeping its last
        ``window`` rows, and its sorted copy follows it: the overwritten rows' scores leave it and the new
        ones join it in one merge pass in C (:func:`_merge`; O(window * E), no sort of the window)."""
        W = self.params.window
        n, E = rows.shape
        ring = self.ring[target]
        if ring is None:
            ring = self.ring[target] = np.empty((W, E), dtype=np.float32)
            self._sorted[target] = np.empty(W * E, dtype=np.float32)
            self._spare[target] = np.empty(W * E, dtype=np.float32)
            if self._best.size < E:
                self._best = np.empty(E, dtype=np.float32)
                self._order = np.empty(E, dtype=np.int64)
        pos, filled = self.pos[target], self.filled[target]
        if n >= W:
            ring[:] = rows[n - W:]
            self.pos[target], self.filled[target] = 0, W
            self._sorted[target][:] = np.sort(ring.reshape(-1))
            return
        if filled == W:  # the rows about to be overwritten: slots pos .. pos + n - 1, wrapping
            gone = ring[pos:pos + n] if pos + n <= W else np.concatenate([ring[pos:], ring[:pos + n - W]])
        else:  # (filling: pos == filled; only slots past the end wrap onto filled rows)
            gone = ring[:max(pos + n - W, 0)]
        gone = np.sort(gone.reshape(-1))
        if pos + n <= W:
            ring[pos:pos + n] = rows
        else:
            ring[pos:] = rows[:W - pos]
            ring[:pos + n - W] = rows[W - pos:]
        count = _merge(self._sorted[target], filled * E, gone, np.sort(rows.reshape(-1)), self._spare[target])
        self._sorted[target], self._spare[target] = self._spare[target], self._sorted[target]
        self.pos[target], self.filled[target] = (pos + n) % W, count // E

    def threshold(self, target: int) -> torch.Tensor:
        """``torch.quantile`` of the target layer's window at the percentile (a 0-dim float32 tensor)."""
        return _lerp(*self._bracket(target))

    def _bracket(self, target: int):
        """The two order statistics of the window the quantile interpolates between, and the weight."""
        count = self.filled[target] * self.ring[target].shape[1]
        points = self._points[target]
        if points is None or points[0] != count:
            points = self._points[target] = (count, *_rank(count, self.params.percentile / 100.0))
        s = self._sorted[target]
        return s[points[1]], s[points[2]], points[3]

    def predict(self, record, model):
        target = model.next_layer(record.layer)
        if target is None:
            return []
        probs, _ = record.predict(target)
        if self.params.basis == "token":
            return [(target, _select(probs, torch.quantile(probs.float(), self.params.percentile / 100.0, dim=-1,
                                                           keepdim=True)))]  # threshold [T, 1]
        rows = probs.detach().float().cpu().numpy()  # [T, E]
        self._push(target, rows)
        a, b, w = self._bracket(target)
        if probs.dtype != torch.float32 or not (math.isfinite(a) and math.isfinite(b)):
            return [(target, _select(probs, _lerp(a, b, w)))]
        # The threshold t = lerp(a, b, w) lies in [a, b], and no score of this prediction lies strictly between
        # a and b (they are consecutive order statistics of a window that holds it): a score is above t when
        # it is >= b, or == a with t == a (a == b, or a lerp that rounds down to a: computed only then).
        take_a = a == b or (_holds(rows, a) and bool(_lerp(a, b, w) <= a))
        return [(target, _chosen(rows, a, b, take_a, self._best, self._order))]


def _merge(s: memoryview, n: int, gone: memoryview, new: memoryview,
           out: memoryview) -> int:
    """``out`` = ``s[:n]`` without ``gone`` (a sub-multiset of it), with ``new``, ascending (all ascending as
    ``np.sort`` orders them, NaN last); returns its length."""
    i = 0
    j = 0
    k = 0
    o = 0
    ng = gone.shape[0]
    nn = new.shape[0]
    if n - ng + nn > out.shape[0] or n > s.shape[0]:
        raise ValueError(f"score prefetch: a window of {n} - {ng} + {nn} scores in a buffer of {out.shape[0]}")
    while i < n:
        v = s[i]
        if j < ng and (v == gone[j] or (v != v and gone[j] != gone[j])):  # (one copy of each gone score)
            i += 1
            j += 1
            continue
        while k < nn and new[k] < v:
            out[o] = new[k]
            o += 1
            k += 1
        out[o] = v
        o += 1
        i += 1
    while k < nn:
        out[o] = new[k]
        o += 1
        k += 1
    if j != ng:
        raise ValueError(f"score prefetch: {ng - j} scores left the window without being in it")
    return o


def _holds(rows: memoryview, a: float) -> bool:
    """Whether some score of ``rows`` equals ``a``."""
    for t in range(rows.shape[0]):
        for e in range(rows.shape[1]):
            if rows[t, e] == a:
                return True
    return False


def _chosen(rows: memoryview, a: float, b: float, take_a: bool,
            best: memoryview, order: memoryview) -> list:
    """The experts some token scores at or above the threshold (``>= b``, or ``== a`` when ``take_a``), by
    descending best score, ties: the lower expert first (:func:`union_by_score`'s order)."""
    T = rows.shape[0]
    E = rows.shape[1]
    m = 0
    if best.shape[0] < E or order.shape[0] < E:
        raise ValueError(f"score prefetch: scratch for {best.shape[0]} experts, rows of {E}")
    for e in range(E):
        best[e] = -1.0
        for t in range(T):
            r = rows[t, e]
            if (r >= b or (take_a and r == a)) and r > best[e]:
                best[e] = r
        if best[e] >= 0:  # insertion: after every selected expert with a score >= its own
            i = m
            while i > 0 and best[order[i - 1]] < best[e]:
                order[i] = order[i - 1]
                i -= 1
            order[i] = e
            m += 1
    return [int(order[i]) for i in range(m)]


def _select(probs: torch.Tensor, threshold: torch.Tensor) -> list[int]:
    """The experts scored at or above ``threshold`` by any token, in :func:`union_by_score`'s order."""
    above = probs >= threshold
    if not bool(above.any()):
        return []
    tokens, experts = above.nonzero(as_tuple=True)
    values = probs[tokens, experts]
    if probs.shape[0] == 1:
        return union_by_score(probs, experts.view(1, -1), values.view(1, -1))
    return union_by_score(probs, experts.view(-1, 1), values.view(-1, 1))


def _rank(n: int, q: float) -> tuple[int, int, np.float32]:
    """torch.quantile's interpolation points among ``n`` sorted values: ``q * (n - 1)`` in float32."""
    rank = np.float32(q) * np.float32(n - 1)
    lo = int(np.floor(rank))
    return lo, int(np.ceil(rank)), rank - np.float32(lo)


def _lerp(a, b, w) -> torch.Tensor:
    """``torch.lerp`` of two float32 values, the op ``torch.quantile`` ends with (a 0-dim float32 tensor)."""
    return torch.lerp(torch.tensor([a], dtype=torch.float32), torch.tensor([b], dtype=torch.float32),
                      torch.tensor([w], dtype=torch.float32)).reshape(())


PREFETCH.register(ScorePrefetch)
