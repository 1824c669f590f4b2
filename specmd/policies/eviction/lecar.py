import math
import random
from dataclasses import dataclass

from ..base import check_choice
from .base import CAPACITY_UNITS, EVICTION, EvictionPolicy
from .structures import KeyHeap, KeyLists


@dataclass
class LeCaRParams:
    learning_rate: float = 0.45
    lru_weight: float = 0.5
    update_weight: bool = True
    seed: int = 0
    capacity_unit: str = "fetch"

    def __post_init__(self):
        check_choice("capacity_unit", self.capacity_unit, CAPACITY_UNITS)
        if not 0.0 <= self.lru_weight <= 1.0:
            raise ValueError(f"lru_weight={self.lru_weight} must be in [0, 1]")
        if not 0.0 <= self.learning_rate <= 700.0:  # a weight is multiplied by exp(learning_rate), at most
            raise ValueError(f"learning_rate={self.learning_rate} must be in [0, 700] (LeCaR's lambda, 0.45 in its "
                             f"paper; 0 freezes the weights, exp(>709) overflows a float64)")


class LeCaR(EvictionPolicy):
    """LeCaR (Vietri et al., HotStorage 2018): regret minimisation over two experts, LRU and LFU. Each
    eviction follows LRU with probability ``w_lru`` (else LFU); the evicted key enters that policy's
    history (size ``c``, the pool's capacity in experts: ``capacity_unit`` as ARC's). A miss on a key found in LRU's history means
    LRU erred: ``w_lfu *= exp(learning_rate * discount**age)`` (and symmetrically), then the weights are
    renormalised; ``discount = 0.005 ** (1/c)`` as in the paper, age in requests since that eviction.
    When both policies name the same victim it is recorded in neither history. Random draws come from
    ``random.Random(seed)``; ``update_weight=false`` freezes the weights (with ``lru_weight`` 1 or 0 this
    is exactly LRU or LFU, which the tests compare with libCacheSim).

    LRU's order is one :class:`~.structures.KeyLists` list, LFU's a :class:`~.structures.KeyHeap` ranking the residents by
    ``(uses, last use, key)``, re-ranked in place. Compiled, an
    extension type (``lecar.pxd``) whose hooks the cache manager calls in C."""

    name = "lecar"
    Params = LeCaRParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self.w_lru = self.params.lru_weight
        self.rng = random.Random(self.params.seed)
        self._recency = KeyLists(1)  # LRU order of resident keys
        self.hist_lru = {}  # evicted key -> request time of eviction
        self.hist_lfu = {}
        self.time = 0
        self.c = 1
        self.discount = 0.005
        self._pending = 0  # the policy that chose the next victim: 1 LRU, 2 LFU, 0 neither
        self._lfu = KeyHeap()  # resident keys by (uses, request time of the last use, key): LFU's choice

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.c = self.capacity_experts(self.params.capacity_unit)
        self.discount = 0.005 ** (1.0 / self.c)

    def resized(self, capacity):
        super().resized(capacity)
        self.c = self.capacity_experts(self.params.capacity_unit)
        self.discount = 0.005 ** (1.0 / self.c)  # (LeCaR: the history's decay over one cache's worth of requests)

    def on_admit(self, key):
        self.time += 1
        if not self.params.update_weight:
            return
        lr = self.params.learning_rate
        w_lru, w_lfu = self.w_lru, 1.0 - self.w_lru
        if key in self.hist_lru:
            w_lfu *= math.exp(lr * self.discount ** (self.time - self.hist_lru.pop(key)))
        elif key in self.hist_lfu:
            w_lru *= math.exp(lr * self.discount ** (self.time - self.hist_lfu.pop(key)))
        else:
            return
        self.w_lru = w_lru / (w_lru + w_lfu)

    @property
    def freq(self) -> dict:
        """Each resident key's uses (a new dict: for checks and tests)."""
        return {k: self._lfu.rank(k) for k in self._lfu.keys()}

    def on_insert(self, key: int, prefetch: bool):
        self._recency.push_back(key)
        self._lfu.set(key, 1, self.time)

    def on_access(self, key: int):
        self.time += 1
        self._recency.move_back(key)
        self._lfu.set(key, self._lfu.rank(key) + 1, self.time)

    def on_remove(self, key: int):
        self._recency.remove(key)
        self._lfu.discard(key)
        hist = self.hist_lru if self._pending == 1 else self.hist_lfu if self._pending == 2 else None
        self._pending = 0
        if hist is not None:
            hist[key] = self.time
            if len(hist) > self.c:
                del hist[next(iter(hist))]

    def victim(self, evictable):
        lru = self._recency.first(0, evictable)
        if lru is None:
            return None
        lfu = self._lfu.first(evictable)  # min (uses, last use): the last use is unique per use
        use_lru = self.rng.random() < self.w_lru
        self._pending = 0 if lru == lfu else (1 if use_lru else 2)
        return lru if use_lru else lfu


EVICTION.register(LeCaR)
