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
import torch

from ...errors import ConfigError
from .base import EVICTION, OrderedEviction

ASSET_FILE = "ml_eviction.safetensors"


def features(last_step: np.ndarray, freq: np.ndarray, step: int) -> np.ndarray:
    """[N, 2] inputs from each expert's last routed step (-1 = never), routed count and the current step."""
    routed = last_step >= 0
    inv_r = np.where(routed, 1.0 / np.maximum(step - last_step + 1, 1), 0.0)
    fmax = freq.max() if freq.size else 0
    f = freq / fmax if fmax > 0 else np.zeros_like(freq, dtype=np.float64)
    return np.stack([inv_r, f], axis=-1).astype(np.float32)


class MLP:
    """The per-layer network, evaluated with torch on the CPU. (Not numpy: numpy's BLAS threads spin
    after each call and starve torch's own threads, which made whole runs 10x slower.)"""

    def __init__(self, tensors: dict):
        self.wt = [torch.from_numpy(np.ascontiguousarray(np.asarray(tensors[f"w{i}"], dtype=np.float32).T))
                   for i in (1, 2, 3)]
        self.b = [torch.from_numpy(np.asarray(tensors[f"b{i}"], dtype=np.float32).copy()) for i in (1, 2, 3)]

    @torch.no_grad()
    def __call__(self, x: np.ndarray) -> np.ndarray:
        silu = torch.nn.functional.silu
        h = silu(torch.addmm(self.b[0], torch.from_numpy(x), self.wt[0]))
        h = silu(torch.addmm(self.b[1], h, self.wt[1]))
        return torch.addmm(self.b[2], h, self.wt[2])[:, 0].numpy()


def resolve_weights(spec: str) -> Path:
    if spec.startswith("specmd:"):
        from ... import ASSETS

        path = ASSETS / spec[len("specmd:"):] / ASSET_FILE
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"eviction=ml: weights {spec!r} not found ({path}); eviction.weights defaults to the "
                          f"model's own networks (model.pretrained), which only specmd's embedded models ship; "
                          f"train some with `python -m specmd.train_eviction --model <model> --out <file>`")
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
class ML(OrderedEviction):
    """FlashMoE's learned eviction (see module docstring). ``weights``: a ``.safetensors`` file written by
    ``python -m specmd.train_eviction``, or ``specmd:<asset>`` for one shipped with a model (the embedded
    ``specmd:tiny-olmoe``, ``specmd:deep-olmoe`` and ``specmd:deep-mixtral`` have one; the config's default is
    the model's own).
    Its layer count must match the model's MoE layers. Recency and frequency count routed uses only (a
    prefetch insert is not a use); they persist after eviction.
    Ties: the lower key."""

    @dataclass
    class Params:
        weights: Optional[str] = "specmd:tiny-olmoe"

        def __post_init__(self):  # the file is found before any model work, or the run stops here
            if self.weights is None:
                raise ConfigError("eviction=ml needs trained networks, and this model ships none (its "
                                  "model.pretrained is null): train them with `python -m specmd.train_eviction "
                                  "--model <model> --out FILE` and set eviction.weights=FILE")
            resolve_weights(self.weights)

    def __init__(self, params=None):
        super().__init__(params or self.Params())
        self.nets: list[MLP] = []

    def attach(self, view, capacity):
        super().attach(view, capacity)
        self.nets, meta = load_networks(self.params.weights)
        geom = view.geometry
        if len(self.nets) != geom.num_layers:
            raise ConfigError(f"eviction=ml: weights {self.params.weights!r} have {len(self.nets)} layers, the model "
                              f"has {geom.num_layers} MoE layers; train matching ones with python -m specmd.train_eviction")
        self.E = geom.num_experts
        L = geom.num_layers
        self.step = [0] * L
        self.fmax = [0.0] * L
        self.last = np.full((L, self.E), -1, dtype=np.int64)
        self.freq = np.zeros((L, self.E), dtype=np.float64)
        # Predictions for all experts of a layer, valid until one of its features changes: the layer's step
        # (``on_layer``) or a use of one of its experts (``_use``, which also moves ``fmax``). A use
        # invalidates even though the used expert is pinned for the rest of its own call: the predictions
        # are read again by later calls of other layers, when it is a candidate (reusing them there chose
        # a stale victim in ~2% of choices).
        self._pred: list = [None] * L

    def on_layer(self, layer, record=None):
        self.step[layer] += 1
        self._pred[layer] = None

    def _use(self, key):
        layer, e = divmod(key, self.E)
        self.last[layer, e] = self.step[layer]
        f = self.freq[layer, e] + 1
        self.freq[layer, e] = f
        if f > self.fmax[layer]:
            self.fmax[layer] = f
        self._pred[layer] = None

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        if not prefetch:
            self._use(key)

    def on_access(self, key):
        self._use(key)

    def predictions(self, layer: int) -> np.ndarray:
        """Predicted next-use distance of every expert of ``layer`` (cached, see ``attach``)."""
        pred = self._pred[layer]
        if pred is None:
            x = features(self.last[layer], self.freq[layer], self.step[layer])
            pred = self._pred[layer] = self.nets[layer](x).tolist()
        return pred

    def victim(self, evictable):
        E = self.E
        best, best_key = None, None
        preds: dict = {}
        for key in self._order:
            if not evictable(key):
                continue
            layer = key // E
            p = preds.get(layer)
            if p is None:
                p = preds[layer] = self.predictions(layer)
            v = p[key - layer * E]
            if best is None or v > best or (v == best and key < best_key):
                best, best_key = v, key
        return best_key
