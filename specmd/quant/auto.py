from dataclasses import dataclass, field
from typing import ClassVar

from .base import NATIVE, QUANT
from .hqq import HQQ


@dataclass
class AutoParams(HQQ.Params):
    precisions: list = field(default_factory=list)  # filled from the miss policy (resolve)
    chosen: ClassVar[bool] = False


class Auto(HQQ):
    """The default: experts at native precision plus exactly the precisions the miss policy asks for
    (``miss=fetch_priority`` -> int8, int4, int2 copies from HQQ; ``miss=fetch`` -> nothing extra, no
    quantization at all). ``quant=hqq`` stores a chosen list instead; ``quant=none`` native only."""

    name = "auto"

    Params = AutoParams

    @classmethod
    def resolve(cls, params, needed):
        params.precisions = [p for p in dict.fromkeys(needed) if p != NATIVE]
        return params


QUANT.register(Auto)
