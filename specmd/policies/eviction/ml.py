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
from .base import EVICTION, LazyHeap, OrderedEviction

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
    after each call and starve torch's own threads, which made whole runs 10x slower.) The activations
    live in buffers made once per batch size and written in place (``out=``, in-place SiLU): the policy
    evaluates one batch of E rows per layer step, and allocating them per call cost a fifth of its time.
    The result is the same bits as the allocating form (checked on the shipped networks). The returned
    array is the output buffer: read it before the next call."""

    def __init__(self, tensors: dict):
        self.wt = [torch.from_numpy(np.ascontiguousarray(np.asarray(tensors[f"w{i}"], dtype=np.float32).T))
                   for i in (1, 2, 3)]
        self.b = [torch.from_numpy(np.asarray(tensors[f"b{i}"], dtype=np.float32).copy()) for i in (1, 2, 3)]
        self._buffers: dict[int, tuple] = {}  # rows -> (x, its tensor, h1, h2, out, out as [rows] numpy)

    def _buffers_for(self, rows: int) -> tuple:
        buf = self._buffers.get(rows)
        if buf is None:
            hidden = self.wt[0].shape[1]
            x = np.empty((rows, self.wt[0].shape[0]), dtype=np.float32)
            out = torch.empty(rows, 1)
            buf = self._buffers[rows] = (x, torch.from_numpy(x), torch.empty(rows, hidden),
                                         torch.empty(rows, self.wt[1].shape[1]), out, out.numpy()[:, 0])
        return buf

    @torch.no_grad()
    def __call__(self, x: np.ndarray) -> np.ndarray:
        buf, xt, h1, h2, out, result = self._buffers_for(len(x))
        buf[...] = x
        silu = torch.nn.functional.silu
        torch.addmm(self.b[0], xt, self.wt[0], out=h1)
        silu(h1, inplace=True)
        torch.addmm(self.b[1], h1, self.wt[1], out=h2)
        silu(h2, inplace=True)
        torch.addmm(self.b[2], h2, self.wt[2], out=out)
        return result


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
    Its layer count must match the model's MoE layers. Ties: the lower key.

    **When the features count a use.** FlashMoE's Algorithm 1 updates every expert's scores for time step
    t ("if the expert is accessed at time t: r_t = 1, f_t = f_{t-1} + 1"; "the frequency score measures how
    many times the expert has been routed"), computes ``dist_scores = ml_cache(score)`` once, and only then
    runs ``CacheReplacement(routed_experts)``, whose every eviction reads those scores. So a use is a
    *routed request* -- a hit (``on_access``) or a demand miss (``on_miss``, whatever becomes of it: fetched,
    streamed, dropped, computed on the host), never a prefetch insert -- and all of a layer call's uses
    are counted before its first victim search (the manager serves hits, then reports every miss, then
    fetches). ``train_eviction.dataset`` labels its features the same way (step t's routed experts marked
    before the features of step t are taken). Counting a use at the insert instead (this policy until
    issue 20) left a streamed or dropped request uncounted and let victim searches inside a call see
    features half-updated, which neither the paper nor the training data has.

    **No scan per eviction.** A layer's predictions only change when its features do: at its next step
    (``on_layer``), and by the uses of its experts, which only its own call makes and which all come before
    the call's first victim search (above); so ``on_layer`` marks the layer dirty, a use does not need to.
    They are computed at most once per step, lazily, for
    the layer's E experts in one batch (the network's cost is per call, not per row), and pushed as
    ``(-distance, key)`` entries for the layer's resident keys into a :class:`~.base.LazyHeap` (an entry is
    live while it is ``_entry[key]``). A victim search re-scores the layers marked dirty that hold
    resident keys (usually the one running), then takes the heap's first evictable entry: the largest
    predicted distance, ties to the lower key. ``test_ml_victims_equal_rescoring_from_scratch`` checks every
    choice against re-scoring every candidate from scratch."""

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
        self._pred: list = [None] * L  # layer -> its E predictions (Python floats), None while dirty
        self._dirty: set[int] = set(range(L))  # layers whose predictions are None
        self._resident: list[set[int]] = [set() for _ in range(L)]  # layer -> its resident keys
        self._entry: dict[int, tuple[float, int]] = {}  # resident key -> its live heap entry (-distance, key)
        self._heap = LazyHeap()

    def _dirty_layer(self, layer: int) -> None:
        if self._pred[layer] is not None:
            self._pred[layer] = None
            self._dirty.add(layer)

    def on_layer(self, layer, record=None):
        self.step[layer] += 1
        self._dirty_layer(layer)

    def _use(self, key):
        layer, e = divmod(key, self.E)
        self.last[layer, e] = self.step[layer]
        f = self.freq[layer, e] + 1
        self.freq[layer, e] = f
        if f > self.fmax[layer]:
            self.fmax[layer] = f

    def on_miss(self, key):
        self._use(key)

    def on_access(self, key):
        self._use(key)

    def on_insert(self, key, prefetch):
        super().on_insert(key, prefetch)
        layer = key // self.E
        self._resident[layer].add(key)
        pred = self._pred[layer]
        if pred is not None:  # else the layer is dirty: its keys are pushed when it is re-scored
            self._heap.put(self._entry, (-pred[key - layer * self.E], key))

    def on_remove(self, key):
        super().on_remove(key)
        self._entry.pop(key, None)
        self._resident[key // self.E].discard(key)

    def predictions(self, layer: int) -> list:
        """Predicted next-use distance of every expert of ``layer`` (cached while its features stand)."""
        pred = self._pred[layer]
        if pred is None:
            x = features(self.last[layer], self.freq[layer], self.step[layer])
            pred = self._pred[layer] = self.nets[layer](x).tolist()
            self._dirty.discard(layer)
        return pred

    def victim(self, evictable):
        dirty = self._dirty
        if dirty:
            resident, E = self._resident, self.E
            for layer in sorted(dirty):  # (a set: iterate a copy; layers without residents stay dirty)
                keys = resident[layer]
                if keys:
                    pred, base, put, entry = self.predictions(layer), layer * E, self._heap.put, self._entry
                    for key in keys:
                        put(entry, (-pred[key - base], key))
        ent = self._heap.first(evictable, self._entry)
        return None if ent is None else ent[1]
