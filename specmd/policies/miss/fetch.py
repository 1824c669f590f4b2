from dataclasses import dataclass

from .base import MISS, MissPolicy


@dataclass
class FetchParams:
    precision: str = "native"

    def __post_init__(self):
        from ...engine.store import BITS

        if self.precision != "native" and self.precision not in BITS:
            raise ValueError(f"precision={self.precision!r}; valid: native, {', '.join(BITS)}")


class Fetch(MissPolicy):
    """Blocking fetch of every miss at ``precision`` (default ``native``: the stored full precision, 100%
    fidelity). ``precision=int4`` with ``quant=hqq`` is SpecMD's "all experts at 4 bit" setting."""

    name = "fetch"

    reads_logits = False  # (Policy.reads_logits)

    Params = FetchParams

    @classmethod
    def lossless(cls, params):
        return params.precision == "native"

    @classmethod
    def required_precisions(cls, params):
        return [params.precision]

    def setup(self, model):
        model.store.check([self.params.precision], f"miss={self.name}")
        self.fetch_precision = self.params.precision

    def handle(self, layer, missing, record, cache):
        return None

    def passive(self):
        return type(self).handle is Fetch.handle  # (a subclass with its own handle is called)


MISS.register(Fetch)
