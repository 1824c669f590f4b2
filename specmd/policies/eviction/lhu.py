from .base import EVICTION
from .lfu import LFU


@EVICTION.register("lhu")
class LHU(LFU):
    """Least High-precision Used (HOBBIT, Tang et al. 2024; SpecMD App. B): LFU over *high-precision*
    uses only, so experts that were used at high precision (whose misses cost the most bytes) stay.

    A use is high-precision when the resident copy has at least ``cache.high_bits`` bits: the highest
    precision the run's miss policy loads (the native dtype under ``miss=fetch``; int8 under
    ``fetch_priority`` with ``int8:4:2``). Without quantization every use is high precision and LHU is
    LFU. Counts persist after eviction (``history``, as LFU); ties: least recently used first."""

    def weight(self, key):
        cache = self.cache
        return 1 if cache is None or cache.entries[key].bits >= cache.high_bits else 0
