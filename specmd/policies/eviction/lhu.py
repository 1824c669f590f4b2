from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION
from .lfu import COUNTS, LFU

HIGH = ("fetch", "native")


@EVICTION.register("lhu")
class LHU(LFU):
    """Least High-precision Used (HOBBIT, Tang et al. 2024; SpecMD App. B): LFU over *high-precision* uses
    only, "prioritizing retention of frequently-accessed high-precision experts since cache misses for these
    incur significantly higher latency. This policy must be combined with fetch cascade precision policies
    (e.g., int8→int4→int2)". Readings:

    * ``high``: which copies are high precision. ``fetch`` (default): at least the bits of the precision
      the miss policy loads first -- the top of the cascade the paper pairs LHU with (int8 under
      ``fetch_priority`` with ``int8:4:2``; the native dtype under ``miss=fetch``). ``native``: only
      copies at the stored native precision (a quantized cascade then never counts, and LHU orders by
      recency alone).
    * ``counts`` (as LFU's): default ``inserts`` here, because a use's precision is that of the copy it
      ran on: an inserted copy and every hit count by their copy's bits, a streamed miss (no copy enters the
      cache) does not count. ``requests`` counts every request, a miss by the fetch precision's bits.

    Without quantization every use is high precision and LHU is LFU with that ``counts``. Counts persist
    after eviction (``history``); ties: least recently counted first."""

    @dataclass
    class Params:
        history: bool = True
        counts: str = "inserts"
        high: str = "fetch"

        def __post_init__(self):
            check_choice("counts", self.counts, COUNTS)
            check_choice("high", self.high, HIGH)

    high_bits = 0

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.high_bits = view.bits_of(view.fetch_precision if self.params.high == "fetch" else "native")

    def weight(self, key):
        bits = self.view.bits(key)
        if bits is None:  # a miss not (yet) resident: it will be loaded at the fetch precision
            bits = self.view.bits_of(self.view.fetch_precision)
        return 1 if bits >= self.high_bits else 0
