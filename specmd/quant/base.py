"""Expert stores at several precisions.

A :class:`QuantMethod` (registered in ``QUANT``, one module per library, config ``conf/quant/<name>.yaml``)
turns the experts module of every MoE layer into an :class:`ExpertStore`: for each precision, the bytes
of one expert (packed weights + scales/zeros + unquantized biases) and, on demand, the dequantized fused
weights of a layer, which are what a low-precision expert really computes with.

Precision names: ``native`` (the model's dtype), ``bf16``/``fp16`` (cast copies), ``int8``, ``int4``,
``int3``, ``int2``. The full precision of a run is the highest stored one.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import torch

from ..policies.base import Policy
from ..registry import Registry

NATIVE = "native"
BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2}
CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_bits(name: str, native_bits: int) -> int:
    return native_bits if name == NATIVE else BITS[name]


def expert_params(experts: torch.nn.Module, num_experts: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The per-expert weight tensors of a fused experts module: 3-D parameters with a leading E axis
    (biases and other small tensors are kept at native precision)."""
    return [(n, p) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == num_experts]


class ExpertStore:
    """Per-precision bytes of one expert and, on demand, an expert's weights at a stored non-native
    precision (dequantized; the most recently used ``cache_experts`` are kept in memory)."""

    def __init__(self, native_bits: int, expert_bytes: int, bytes_of: dict[str, int],
                 loader: Optional[Any] = None, cache_experts: int = 1024):
        self.native_bits = native_bits
        self.bytes_of = {NATIVE: expert_bytes, **bytes_of}
        self.bits_of = {p: precision_bits(p, native_bits) for p in self.bytes_of}
        # stored precisions, highest first (ties: native first)
        self.precisions = sorted(self.bytes_of, key=lambda p: (-self.bits_of[p], p != NATIVE))
        self.full = self.precisions[0]
        self.lowest = self.precisions[-1]
        self._loader = loader  # (layer, expert, precision) -> {param name: tensor of that expert}
        self._dequant: "OrderedDict[tuple[int, int, str], dict[str, torch.Tensor]]" = OrderedDict()
        self._cache_experts = cache_experts

    def resized(self, bytes_of: dict) -> "ExpertStore":
        """The same store (weights, precisions, bits) with other bytes per precision: the sizes a real
        model's experts would have (``hardware.timing_as``)."""
        import copy

        out = copy.copy(self)
        out.bytes_of = dict(bytes_of)
        return out

    def check(self, names, where: str) -> None:
        for p in names:
            if p not in self.bytes_of:
                from ..errors import ConfigError

                raise ConfigError(f"{where}: precision {p!r} is not stored; stored: {', '.join(self.precisions)} "
                                  f"(set quant=hqq and quant.precisions)")

    def weights(self, layer: int, expert: int, precision: str) -> dict[str, torch.Tensor]:
        key = (layer, expert, precision)
        cache = self._dequant
        w = cache.get(key)
        if w is None:
            w = cache[key] = self._loader(layer, expert, precision)
            if len(cache) > self._cache_experts:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return w


class QuantMethod(Policy):
    """Builds the :class:`ExpertStore` of a model (``build(model, experts_modules, geometry, tag)``)."""

    @classmethod
    def resolve(cls, params, needed: list[str]):
        """Adapt ``params`` to the precisions the run's miss policy needs (``quant=auto`` stores exactly
        those); other methods keep what the user configured."""
        return params

    @classmethod
    def stored_precisions(cls, params) -> list[str]:
        """The precision names a store built with ``params`` will hold."""
        return [NATIVE] + list(getattr(params, "precisions", None) or [])

    def build(self, experts: list[torch.nn.Module], num_experts: int, tag: str) -> ExpertStore:
        raise NotImplementedError


def cache_dir() -> Path:
    root = os.environ.get("SPECMD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specmd")
    return Path(root) / "quant"


def model_fingerprint(experts: list[torch.nn.Module], num_experts: int, tag: str) -> str:
    """Identifies the expert weights cheaply: the model tag plus a hash of every layer's first expert."""
    h = hashlib.sha256(tag.encode())
    for mod in experts:
        for name, p in expert_params(mod, num_experts):
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach()[0].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


QUANT: Registry[QuantMethod] = Registry("quant", "specmd.quant")
