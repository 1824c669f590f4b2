"""What the engine knows of the expert store: the stored precisions and the bytes of one expert at each.

The weights themselves (quantized copies, their loaders) live in :class:`specmd.quant.base.ExpertStore`,
which extends this class; the engine, the clock and the replay driver need only the sizes, so a trace
replay builds a :class:`StoreSizes` from the trace's meta and never imports a quantization library.
"""

from __future__ import annotations

from ..errors import ConfigError
from .outcomes import NATIVE

BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2}


def precision_bits(name: str, native_bits: int) -> int:
    return native_bits if name == NATIVE else BITS[name]


class StoreSizes:
    """``bytes_of[precision]``: bytes of one expert at each stored precision (``native`` always);
    ``bits_of``; ``precisions`` highest first (ties: native first); ``full`` / ``lowest``."""

    def __init__(self, native_bits: int, expert_bytes: int, bytes_of: dict[str, int]):
        self.native_bits = native_bits
        self.bytes_of = {NATIVE: expert_bytes, **bytes_of}
        self.bits_of = {p: precision_bits(p, native_bits) for p in self.bytes_of}
        self.precisions = sorted(self.bytes_of, key=lambda p: (-self.bits_of[p], p != NATIVE))
        self.full = self.precisions[0]
        self.lowest = self.precisions[-1]

    @classmethod
    def native_only(cls, geom) -> "StoreSizes":
        """The store of a run without quantized copies: the model's own experts at its dtype."""
        return cls(geom.dtype_bytes * 8, geom.expert_bytes, {})

    @classmethod
    def from_meta(cls, meta: dict) -> "StoreSizes":
        """From a trace's ``store`` meta (``native_bits``, ``bytes_of``)."""
        bytes_of = meta["bytes_of"]
        return cls(int(meta["native_bits"]), int(bytes_of[NATIVE]),
                   {p: int(b) for p, b in bytes_of.items() if p != NATIVE})

    def resized(self, bytes_of: dict) -> "StoreSizes":
        """The same store (weights, precisions, bits) with other bytes per precision: the sizes a real
        model's experts would have (``hardware.timing_as``)."""
        import copy

        out = copy.copy(self)
        out.bytes_of = dict(bytes_of)
        return out

    def check(self, names, where: str) -> None:
        for p in names:
            if p not in self.bytes_of:
                raise ConfigError(f"{where}: precision {p!r} is not stored; stored: {', '.join(self.precisions)} "
                                  f"(set quant=hqq and quant.precisions)")
