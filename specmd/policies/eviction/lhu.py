from .base import EVICTION, EvictionPolicy, argmin_key


@EVICTION.register("lhu")
class LHU(EvictionPolicy):
    """Least High-precision Used (HOBBIT, Tang et al. 2024; SpecMD App. B): LFU over *high-precision*
    uses only, so experts that were used at high precision (whose misses cost the most bytes) stay.

    A use is high-precision when the resident copy has at least ``cache.high_bits`` bits: the highest
    precision the run's miss policy loads (the native dtype under ``miss=fetch``; int8 under
    ``fetch_priority`` with ``int8:4:2``). Without quantization every use is high precision and LHU is
    LFU. Counts persist after eviction; ties: least recently used first."""

    def __init__(self, params=None, keys=None):
        super().__init__(params, keys)
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.resident: dict[int, None] = {}
        self.clock = 0

    def _touch(self, key):
        self.clock += 1
        self.last[key] = self.clock
        cache = self.cache
        high = cache is None or cache.entries[key].bits >= cache.high_bits
        self.count[key] = self.count.get(key, 0) + (1 if high else 0)

    def on_insert(self, key, prefetch):
        self.resident[key] = None
        self._touch(key)

    def on_access(self, key):
        self._touch(key)

    def on_remove(self, key):
        del self.resident[key]

    def victim(self, evictable):
        count, last = self.count, self.last
        return argmin_key(self.resident, evictable, lambda k: (count[k], last[k]))
