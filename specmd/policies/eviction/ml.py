"""FlashMoE's ML-based eviction (Kim et al., FlashMoE §3.2): a small per-layer feed-forward network maps
each expert's normalised recency and frequency to a predicted next-use distance, trained on Belady's
oracle distances from routing traces; the resident expert with the largest prediction is evicted.

Features at a layer's step t (a step = one call of that layer; a decode token): ``1/r`` where ``r`` is the
number of steps since the expert was last routed (1 = routed at this step; never routed -> 0), and
``f / max f`` with ``f`` the number of steps it was routed so far (max over the layer's experts).
Target: ``min(d, cap) / cap`` with ``d`` the steps until its next use (never again -> 1). Network: 2 -> 128
-> 128 -> 1, SiLU (FlashMoE Table 1: 3 layers, hidden 128, SiLU, MSE, AdamW lr 1e-3, decay 1e-2).
Train one with ``python -m specmd.train_eviction`` (from any model's routing or saved run traces).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ...errors import ConfigError
from .base import EVICTION, EvictionPolicy

ASSET_FILE = "ml_eviction.safetensors"


def features(last_step: np.ndarray, freq: np.ndarray, step: int) -> np.ndarray:
    """[N, 2] inputs from each expert's last routed step (-1 = never), routed count and the current step."""
    routed = last_step >= 0
    inv_r = np.where(routed, 1.0 / np.maximum(step - last_step + 1, 1), 0.0)
    fmax = freq.max() if freq.size else 0
    f = freq / fmax if fmax > 0 else np.zeros_like(freq, dtype=np.float64)
    return np.stack([inv_r, f], axis=-1).astype(np.float32)


class MLP:
    """The per-layer network in numpy (inference only; microseconds for a few hundred candidates)."""

    def __init__(self, tensors: dict):
        self.w = [np.asarray(tensors[f"w{i}"], dtype=np.float32) for i in (1, 2, 3)]
        self.b = [np.asarray(tensors[f"b{i}"], dtype=np.float32) for i in (1, 2, 3)]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for i in range(3):
            x = x @ self.w[i].T + self.b[i]
            if i < 2:
                x = x / (1.0 + np.exp(-x))  # SiLU
        return x[:, 0]


def resolve_weights(spec: str) -> Path:
    if spec.startswith("specmd:"):
        from ...models.loader import ASSETS

        path = ASSETS / spec[len("specmd:"):] / ASSET_FILE
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"eviction=ml: weights {spec!r} not found ({path}); train some with "
                          f"`python -m specmd.train_eviction --model <model> --out <file>`")
    return path


def load_networks(spec: str) -> tuple[list[MLP], dict]:
    from safetensors.numpy import load_file
    from safetensors import safe_open

    path = resolve_weights(spec)
    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = dict(f.metadata() or {})
    layers = int(meta.get("num_layers", 0)) or len({k.split(".")[0] for k in tensors})
    nets = [MLP({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"layer{l}.")})
            for l in range(layers)]
    return nets, meta


@EVICTION.register("ml")
class ML(EvictionPolicy):
    """FlashMoE's learned eviction (see module docstring). ``weights``: a ``.safetensors`` file written by
    ``python -m specmd.train_eviction``, or ``specmd:<asset>`` for one shipped with a model (the embedded
    ``specmd:tiny-olmoe`` has one). Its layer count must match the model's MoE layers. Recency and
    frequency count routed uses only (a prefetch insert is not a use); they persist after eviction.
    Ties: the lower key."""

    @dataclass
    class Params:
        weights: str = "specmd:tiny-olmoe"

    def __init__(self, params=None, keys=None):
        super().__init__(params or self.Params(), keys)
        self.nets: list[MLP] = []
        self.resident: dict[int, None] = {}

    def attach(self, cache, pool):
        super().attach(cache, pool)
        self.nets, meta = load_networks(self.params.weights)
        geom = cache.geom
        if len(self.nets) != geom.num_layers:
            raise ConfigError(f"eviction=ml: weights {self.params.weights!r} have {len(self.nets)} layers, the model "
                              f"has {geom.num_layers} MoE layers; train matching ones with python -m specmd.train_eviction")
        self.E = geom.num_experts
        self.step = np.zeros(geom.num_layers, dtype=np.int64)
        self.last = np.full((geom.num_layers, self.E), -1, dtype=np.int64)
        self.freq = np.zeros((geom.num_layers, self.E), dtype=np.float64)

    def on_layer(self, layer):
        self.step[layer] += 1

    def _use(self, key):
        layer, e = divmod(key, self.E)
        self.last[layer, e] = self.step[layer]
        self.freq[layer, e] += 1

    def on_insert(self, key, prefetch):
        self.resident[key] = None
        if not prefetch:
            self._use(key)

    def on_access(self, key):
        self._use(key)

    def on_remove(self, key):
        del self.resident[key]

    def victim(self, evictable):
        cands = [k for k in self.resident if evictable(k)]
        if not cands:
            return None
        keys = np.asarray(cands, dtype=np.int64)
        layers, experts = np.divmod(keys, self.E)
        pred = np.empty(len(keys), dtype=np.float32)
        for layer in np.unique(layers):
            sel = layers == layer
            x = features(self.last[layer], self.freq[layer], int(self.step[layer]))[experts[sel]]
            pred[sel] = self.nets[layer](x)
        best = pred.max()
        return int(keys[pred == best].min())
