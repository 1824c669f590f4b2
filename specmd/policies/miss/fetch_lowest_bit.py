from dataclasses import dataclass

from .base import MISS, MissPolicy, parse_cascade


@dataclass
class FetchLowestBitParams:
    precisions: str = "int8:4:2"

    def __post_init__(self):
        self.cascade = parse_cascade(self.precisions)


class FetchLowestBit(MissPolicy):
    """Fetch Lowest Bit (SpecMD §5.4): experts are stored at the cascade ``precisions`` and every miss (and
    every prefetch) is fetched at its lowest one (``int8:4:2`` -> int2)."""

    name = "fetch_lowest_bit"

    reads_logits = False  # (Policy.reads_logits)

    Params = FetchLowestBitParams

    @classmethod
    def required_precisions(cls, params):
        return list(params.cascade)

    def setup(self, model):
        model.store.check(self.params.cascade, f"miss={self.name}")
        self.fetch_precision = min(self.params.cascade, key=lambda p: model.store.bits_of[p])

    def handle(self, layer, missing, record, cache):
        return None


MISS.register(FetchLowestBit)
