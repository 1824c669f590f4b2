import math
import random
from dataclasses import dataclass

from ..base import check_choice
from .base import CAPACITY_UNITS, EVICTION, EvictionPolicy, LazyHeap


@EVICTION.register("lecar")
class LeCaR(EvictionPolicy):
    """LeCaR (Vietri et al., HotStorage 2018): regret minimisation over two experts, LRU and LFU. Each
    eviction follows LRU with probability ``w_lru`` (else LFU); the evicted key enters that policy's
    history (size ``c``, the pool's capacity in experts: ``capacity_unit`` as ARC's). A miss on a key found in LRU's history means
    LRU erred: ``w_lfu *= exp(learning_rate * discount**age)`` (and symmetrically), then the weights are
    renormalised; ``discount = 0.005 ** (1/c)`` as in the paper, age in requests since that eviction.
    When both policies name the same victim it is recorded in neither history. Random draws come from
    ``random.Random(seed)``; ``update_weight=false`` freezes the weights (with ``lru_weight`` 1 or 0 this
    is exactly LRU or LFU, which the tests compare with libCacheSim)."""

    @dataclass
    class Params:
        learning_rate: float = 0.45
        lru_weight: float = 0.5
        update_weight: bool = True
        seed: int = 0
        capacity_unit: str = "fetch"

        def __post_init__(self):
            check_choice("capacity_unit", self.capacity_unit, CAPACITY_UNITS)
            if not 0.0 <= self.lru_weight <= 1.0:
                raise ValueError(f"lru_weight={self.lru_weight} must be in [0, 1]")
            if not self.learning_rate >= 0.0:
                raise ValueError(f"learning_rate={self.learning_rate} must be >= 0 (LeCaR's lambda; 0 freezes the weights)")

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.w_lru = self.params.lru_weight
        self.rng = random.Random(self.params.seed)
        self.recency: dict[int, None] = {}  # LRU order of resident keys
        self.freq: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.hist_lru: dict[int, int] = {}  # evicted key -> request time of eviction
        self.hist_lfu: dict[int, int] = {}
        self.time = 0
        self.c = 1
        self.discount = 0.005
        self._pending = None  # the policy that chose the next victim
        self._lfu = LazyHeap()  # (freq, last, key) of resident keys: LFU's choice without a scan
        self._entry: dict[int, tuple[int, int, int]] = {}

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.c = self.capacity_experts(self.params.capacity_unit)
        self.discount = 0.005 ** (1.0 / self.c)

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

    def _rank(self, key):
        self._lfu.put(self._entry, (self.freq[key], self.last[key], key))

    def on_insert(self, key, prefetch):
        self.recency[key] = None
        self.freq[key] = 1
        self.last[key] = self.time
        self._rank(key)

    def on_access(self, key):
        self.time += 1
        del self.recency[key]
        self.recency[key] = None
        self.freq[key] += 1
        self.last[key] = self.time
        self._rank(key)

    def on_remove(self, key):
        del self.recency[key]
        del self.freq[key]
        del self.last[key]
        del self._entry[key]
        hist = {"lru": self.hist_lru, "lfu": self.hist_lfu}.get(self._pending)
        self._pending = None
        if hist is not None:
            hist[key] = self.time
            if len(hist) > self.c:
                del hist[next(iter(hist))]

    def victim(self, evictable):
        lru = next((k for k in self.recency if evictable(k)), None)
        if lru is None:
            return None
        lfu = self._lfu.first(evictable, self._entry)[2]  # min (freq, last): last is unique per use
        use_lru = self.rng.random() < self.w_lru
        self._pending = None if lru == lfu else ("lru" if use_lru else "lfu")
        return lru if use_lru else lfu
