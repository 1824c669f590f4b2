from dataclasses import dataclass

from .base import MISS, Dropped, Fetched, MissPolicy, best_ranks


@dataclass
class DropParams:
    J: int = 2

    def __post_init__(self):
        if self.J < 0:
            raise ValueError(f"J={self.J} must be >= 0")


class Drop(MissPolicy):
    """Drop low-ranked misses (Skliar et al. 2025; SpecMD §3.1.2): a missing expert is fetched if some token
    ranks it among its top ``J`` (0-based rank < J), otherwise it does not run for this call (its weight is
    zeroed, the others are not renormalised). ``J = 0`` drops every miss."""

    name = "drop"

    Params = DropParams

    def handle(self, layer, missing, record, cache):
        ranks = best_ranks(record, missing)
        fetch = Fetched()
        drop = Dropped()
        return [fetch if r < self.params.J else drop for r in ranks]


MISS.register(Drop)
