"""Quantized expert copies (the ``quant`` config group): which precisions each expert is stored at, the
bytes of each (capacity and transfer time), and the real low-precision weights a lossy expert runs with."""

from .base import NATIVE, QUANT, ExpertStore, QuantMethod

__all__ = ["NATIVE", "QUANT", "ExpertStore", "QuantMethod"]
