from dataclasses import dataclass

from ..base import check_choice
from .base import EVICTION
from .lfu import COUNTS, LFU

HIGH = ("fetch", "native")


@dataclass
class LHUParams:
    history: bool = True
    counts: str = "inserts"
    high: str = "fetch"

    def __post_init__(self):
        check_choice("counts", self.counts, COUNTS)
        check_choice("high", self.high, HIGH)


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

    Without quantization every use is high precision and LHU is LFU with that ``counts`` (then a use's
    weight is 1 without asking the view: every stored precision is high). Counts persist after eviction
    (``history``); ties: least recently counted first. Compiled, an extension type (``lhu.pxd``) on LFU's."""

    name = "lhu"
    Params = LHUParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self.high_bits = 0
        self._all_high = False

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.high_bits = view.bits_of(view.fetch_precision if self.params.high == "fetch" else "native")
        stored = getattr(view, "precisions", None)  # (every precision a copy or a fetch can have)
        self._all_high = stored is not None and all(view.bits_of(p) >= self.high_bits for p in stored)

    def weight(self, key: int) -> int:
        if self._all_high:
            return 1
        bits = self.view.bits(key)
        if bits is None:  # a miss not (yet) resident: it will be loaded at the fetch precision
            bits = self.view.bits_of(self.view.fetch_precision)
        return 1 if bits >= self.high_bits else 0


EVICTION.register(LHU)
