from .base import EVICTION
from .lfu import LFU


@EVICTION.register("lhu")
class LHU(LFU):
    """Least High-precision Used (HOBBIT, Tang et al. 2024; SpecMD App. B): LFU over *high-precision*
    uses only, so experts that were used at high precision (whose misses cost the most bytes) stay.

    A use is high-precision when the resident copy has at least ``high_bits`` bits: those of the
    precision the run's miss policy loads (the native dtype under ``miss=fetch``; int8 under
    ``fetch_priority`` with ``int8:4:2``). Without quantization every use is high precision and LHU is
    LFU. Counts persist after eviction (``history``, as LFU); ties: least recently used first."""

    high_bits = 0

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.high_bits = view.bits_of(view.fetch_precision)

    def weight(self, key):
        return 1 if self.view.bits(key) >= self.high_bits else 0
