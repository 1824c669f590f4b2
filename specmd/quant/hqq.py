"""Expert copies quantized with HQQ (Badri & Shaji 2023, half-quadratic quantization; data-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from .base import (
    BITS,
    CAST,
    QUANT,
    ExpertStore,
    QuantMethod,
    cache_dir,
    expert_params,
    load_or_compute,
    model_fingerprint,
)

INT = ("int8", "int4", "int3", "int2")


def dequantize(wq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, meta: dict, device) -> torch.Tensor:
    """One expert's weight from its bit-packed ``wq`` and fp16 ``scale``/``zero`` (HQQ's arithmetic, in
    float32): the one dequantization of a stored copy, wherever its bytes are (the store's copy in host memory
    for ``execution=simulated``, an arena slot for ``execution=offload``)."""
    from hqq.core.quantize import Quantizer

    m = dict(meta, scale=scale.to(device=device, dtype=torch.float32), zero=zero.to(device=device, dtype=torch.float32),
             compute_dtype=torch.float32)
    return Quantizer.dequantize(wq.to(device), m)


@dataclass
class HQQParams:
    precisions: list = field(default_factory=lambda: ["int8", "int4", "int2"])
    group_size: int = 64
    optimize: bool = True
    cache_experts: int = 1024
    chosen: ClassVar[bool] = True  # the list is the user's (quant=auto fills it from the miss policy)

    def __post_init__(self):
        self.precisions = [str(p) for p in self.precisions]
        if not self.precisions and self.chosen:
            raise ValueError("precisions=[] stores no quantized copy: list at least one (e.g. [int8, int4]) or "
                             "use quant=none")
        twice = sorted({p for p in self.precisions if self.precisions.count(p) > 1})
        if twice:
            raise ValueError(f"precisions={self.precisions} lists {twice} twice")
        for p in self.precisions:
            if p not in BITS or p == "fp32":
                raise ValueError(f"precision {p!r}; valid choices: bf16, fp16, {', '.join(INT)}")
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")


class HQQ(QuantMethod):
    """Every expert is stored at ``native`` plus each of ``precisions`` (any of bf16, fp16, int8, int4,
    int3, int2). Integer copies come from ``hqq`` (asymmetric, ``group_size`` weights per scale/zero along
    the input axis, half-quadratic refinement when ``optimize``), one call per fused weight tensor with
    each expert's rows bit-packed separately (identical to per-expert quantization without ``optimize``;
    with it, only HQQ's early-stopping test is shared across a layer's experts); bytes per expert count the bit-packed weights plus one fp16 scale and zero per group,
    biases stay native. The scale and zero are *stored* as fp16, the bytes counted (HQQ computes them in
    float32 here; kept that way, a copy would hold 4-byte figures that the byte count and every transfer time
    call 2-byte ones, and ``execution=offload`` could not move what the engine counts); dequantization
    computes in float32 from the fp16 figures. Integer copies are cached on disk, one file per precision in ``$SPECMD_CACHE/quant``
    (default ``~/.cache/specmd/quant``), named by a fingerprint of all experts' weights
    (:func:`~specmd.quant.base.model_fingerprint`), the precision, ``group_size``, ``optimize`` and the hqq
    version, so sweeps never re-quantize. Each file stores that key and a SHA-256 of its payload, both
    checked on every load; a file failing a check (truncated, corrupted, another key's) is logged as a
    WARNING naming it and the reason, renamed to ``<name>.bad-<token>`` and recomputed. Of concurrent
    processes needing the same file, one quantizes and the others wait on a file lock and then load it
    (:func:`~specmd.quant.base.load_or_compute`). An expert is
    dequantized when it first runs at a low precision (the last ``cache_experts`` are kept).

    Why HQQ: it needs no calibration data, supports int2/int3 (quanto has no int3; bitsandbytes no
    int2), and runs on CPU and GPU; the dequantized weights run in the family's own fused kernel, so the
    lossy output is the real quantized weights' output."""

    name = "hqq"

    Params = HQQParams

    def build(self, experts, num_experts, tag):
        from ..executor.kernel import expert_tensors

        native_dtype = next(experts[0].parameters()).dtype
        native_bits = torch.finfo(native_dtype).bits
        expert_bytes = sum(p.numel() * p.element_size()
                           for p in expert_tensors(experts[0], num_experts).values()) // num_experts
        weights = expert_params(experts[0], num_experts)
        other_bytes = expert_bytes - sum(p[0].numel() * p.element_size() for _, p in weights)
        fp = model_fingerprint(experts, num_experts, tag) if any(p in INT for p in self.params.precisions) else None
        packed: dict[str, list] = {}
        bytes_of = {}
        for prec in self.params.precisions:
            if prec in CAST:
                bytes_of[prec] = other_bytes + sum(p[0].numel() for _, p in weights) * 2
                continue
            layers = self._load_or_quantize(experts, num_experts, prec, fp)
            packed[prec] = layers
            per = sum(q["wq"][0].numel() * q["wq"].element_size() + 2 * (q["scale"][0].numel() + q["zero"][0].numel())
                      for q in layers[0].values())
            bytes_of[prec] = other_bytes + per

        per_expert = list(expert_tensors(experts[0], num_experts))  # (the tensors expert_bytes counts)
        quantized = [n for n, _ in weights]
        others = [n for n in per_expert if n not in quantized]  # biases: native in every copy

        def raw(layer, expert, prec):
            """{name: tensor}: quantized weights as ``<name>.wq`` (bit-packed uint8), ``<name>.scale`` and
            ``<name>.zero`` (fp16), a cast copy as ``<name>``, then the native biases."""
            mod = experts[layer]
            out = {}
            for n in quantized:
                p = getattr(mod, n).detach()
                if prec in CAST:
                    out[n] = p[expert].to(CAST[prec])
                    continue
                q = packed[prec][layer][n]
                out[n + ".wq"], out[n + ".scale"], out[n + ".zero"] = q["wq"][expert], q["scale"][expert], q["zero"][expert]
            for n in others:
                out[n] = getattr(mod, n).detach()[expert]
            return out

        def unpack(layer, prec, r, device):
            mod = experts[layer]
            out = {}
            for n in quantized:
                shape = getattr(mod, n).shape[1:]
                if prec in CAST:
                    out[n] = r[n].to(device).to(native_dtype)
                else:
                    out[n] = dequantize(r[n + ".wq"], r[n + ".scale"], r[n + ".zero"], packed[prec][layer][n]["meta"],
                                        device).reshape(shape).to(native_dtype)
            for n in others:
                out[n] = r[n].to(device)
            return out

        def load(layer, expert, prec):  # native experts run in place; only other precisions come through here
            return unpack(layer, prec, raw(layer, expert, prec), next(experts[layer].parameters()).device)

        return ExpertStore(native_bits, expert_bytes, bytes_of, load, self.params.cache_experts, raw, unpack)

    def _quantize_fused(self, p, num_experts, nbits, g, Quantizer) -> dict:
        """One HQQ call over the fused [E*out, in] matrix (groups never span rows, so each expert's groups
        are its own; only HQQ's early-stopping test is shared), then each expert's rows are bit-packed
        separately so that one expert dequantizes on its own. Returns the layer's copy of this weight as three
        ``[E, ...]`` tensors (``wq`` bit-packed uint8, fp16 ``scale`` and ``zero``; expert ``e``'s are row ``e``
        of each) and the ``meta`` HQQ dequantizes with, the same for every expert: a few tensors per layer, not
        three per expert, so that a cached file loads in milliseconds (``torch.load`` spends ~15 us per tensor:
        the tiny OLMoE's 1,536 per-expert tensors took 100 ms a precision, more than quantizing them)."""
        shape = tuple(p.shape[1:])
        w = p.float().reshape(-1, shape[-1])
        group = g if shape[-1] % g == 0 else None
        wq, meta = Quantizer.quantize(w, nbits=nbits, group_size=group, optimize=self.params.optimize, axis=1,
                                      bitpack=False, compute_dtype=torch.float32, device=str(w.device))
        packing = Quantizer.bit_to_packing[nbits]
        rows = wq.shape[0] // num_experts
        wq = wq.to(torch.uint8).reshape(num_experts, rows, *wq.shape[1:])  # [E, rows, group]
        scale, zero = (meta[k].to(torch.float16).cpu().reshape(num_experts, rows, *meta[k].shape[1:])
                       for k in ("scale", "zero"))  # [E, rows, 1] each
        return {"wq": torch.stack([Quantizer.pack[packing](wq[e]).cpu() for e in range(num_experts)]),  # [E, packed]
                "scale": scale, "zero": zero,
                "meta": {"nbits": nbits, "group_size": group, "shape": shape, "axis": 1, "packing": packing,
                         "unpack_view_dtype": Quantizer.unpack_view_dtype[packing], "view_as_float": False}}

    def cache_key(self, prec: str, fp: str) -> dict:
        """What a cached copy depends on; stored in the file and compared on every load."""
        from importlib.metadata import version

        return {"fingerprint": fp, "method": "hqq", "precision": prec, "group_size": int(self.params.group_size),
                "optimize": bool(self.params.optimize), "hqq": version("hqq"), "scale_zero": "fp16",
                "layout": "per-layer"}

    def cache_path(self, prec: str, fp: str) -> Path:
        k = self.cache_key(prec, fp)
        return cache_dir() / f"{fp}-hqq-{prec}-g{k['group_size']}-o{int(k['optimize'])}-hqq{k['hqq']}-sz16-pl.pt"

    def _load_or_quantize(self, experts, num_experts, prec, fp):
        path = self.cache_path(prec, fp)
        return load_or_compute(path, self.cache_key(prec, fp),
                               lambda: self._quantize_all(experts, num_experts, prec, path))

    def _quantize_all(self, experts, num_experts, prec, path):
        from hqq.core.quantize import Quantizer
        from tqdm.auto import tqdm

        layers = []
        # the first run of a model x precision quantizes every expert (minutes on a real model); later runs load
        for mod in tqdm(experts, desc=f"HQQ-quantizing experts to {prec} (once; cached in {path.parent})",
                        unit="layer"):
            entry = {}
            for n, p in expert_params(mod, num_experts):
                entry[n] = self._quantize_fused(p.detach(), num_experts, BITS[prec], self.params.group_size, Quantizer)
            layers.append(entry)
        return layers


QUANT.register(HQQ)
