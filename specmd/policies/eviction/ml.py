# cython: wraparound=False, nonecheck=False
# (compiled: the network's loops index flat weight arrays from offsets >= 0, with no None check per element;
# every hook first reads a typed array, which raises on an instance whose __init__ never ran)
"""FlashMoE's ML-based eviction (Kim et al., FlashMoE §3.2): a small per-layer feed-forward network maps
each expert's normalised recency and frequency to a predicted next-use distance, trained on Belady's
oracle distances from routing traces; the resident expert with the largest prediction is evicted.

Features at a layer's step t (a step = one call of that layer; a decode token): ``1/r`` where ``r`` is the
number of steps since the expert was last routed (1 = routed at this step; never routed -> 0), and
``f / max f`` with ``f`` the number of steps it was routed so far (max over the layer's experts).
Target: ``min(d, cap) / cap`` with ``d`` the steps until its next use (never again -> 1). Network: 2 -> 128
-> 128 -> 1, SiLU (FlashMoE Table 1: 3 layers, hidden 128, SiLU, MSE, AdamW lr 1e-3, decay 1e-2).
Train one with ``specmd train-eviction`` (from any model's routing or saved run traces).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import math
from array import array

import numpy as np

from ...errors import ConfigError
from .base import EVICTION, EvictionPolicy
from .structures import KeyHeap

ASSET_FILE = "ml_eviction.safetensors"
EXP_MAX = 700.0  # SiLU's exp(-z) for z below -EXP_MAX: 0 (C's exp overflows to inf there, Python's raises)
# SiLU's exp: libm's, as ``math.exp`` (run as source) or called in C (compiled: ml.pxd cimports libc's ``exp``
# under this name, which a Python assignment to it would contradict, hence no ``import`` statement)
globals().setdefault("exp", math.exp)


def features(last_step: np.ndarray, freq: np.ndarray, step: int) -> np.ndarray:
    """[N, 2] inputs from each expert's last routed step (-1 = never), routed count and the current step
    (the training set's; the policy computes the same two numbers per expert, :meth:`ML.row`)."""
    routed = last_step >= 0
    inv_r = np.where(routed, 1.0 / np.maximum(step - last_step + 1, 1), 0.0)
    fmax = freq.max() if freq.size else 0
    f = freq / fmax if fmax > 0 else np.zeros_like(freq, dtype=np.float64)
    return np.stack([inv_r, f], axis=-1).astype(np.float32)


def resolve_weights(spec: str) -> Path:
    if spec.startswith("specmd:"):
        from ... import ASSETS

        path = ASSETS / spec[len("specmd:"):] / ASSET_FILE
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"eviction=ml: weights {spec!r} not found ({path}); eviction.weights defaults to the "
                          f"model's own networks (model.pretrained), which only specmd's embedded models ship; "
                          f"train some with `specmd train-eviction --model <model> --out <file>`")
    return path


def load_networks(spec: str) -> tuple[list[dict], dict]:
    """Each MoE layer's network as its tensors (``w1`` [H, 2], ``b1`` [H], ``w2`` [H, H], ``b2`` [H], ``w3``
    [1, H], ``b3`` [1]: torch's ``Linear`` layout, float32) and the file's metadata."""
    from safetensors.numpy import load_file
    from safetensors import safe_open

    path = resolve_weights(spec)
    tensors = load_file(str(path))
    with safe_open(str(path), "np") as f:
        meta = dict(f.metadata() or {})
    layers = int(meta.get("num_layers", 0)) or len({k.split(".")[0] for k in tensors})
    nets = [{k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"layer{l}.")} for l in range(layers)]
    H = None
    for l, net in enumerate(nets):
        try:
            H = H or net["w1"].shape[0]
            shapes = {k: tuple(net[k].shape) for k in ("w1", "b1", "w2", "b2", "w3", "b3")}
        except KeyError as e:
            raise ConfigError(f"eviction=ml: weights {spec!r} have no tensor layer{l}.{e.args[0]}") from None
        want = {"w1": (H, 2), "b1": (H,), "w2": (H, H), "b2": (H,), "w3": (1, H), "b3": (1,)}
        if shapes != want:
            raise ConfigError(f"eviction=ml: weights {spec!r}, layer {l}: tensor shapes {shapes}; a 2 -> {H} -> {H} "
                              f"-> 1 network needs {want}")
        if not all(np.isfinite(net[k]).all() for k in want):
            raise ConfigError(f"eviction=ml: weights {spec!r}, layer {l}: non-finite values")
    return nets, meta


@dataclass
class MLParams:
    weights: Optional[str] = "specmd:tiny-olmoe"

    def __post_init__(self):  # the file is found before any model work, or the run stops here
        if self.weights is None:
            raise ConfigError("eviction=ml needs trained networks, and this model ships none (its "
                              "model.pretrained is null): train them with `specmd train-eviction "
                              "--model <model> --out FILE` and set eviction.weights=FILE")
        resolve_weights(self.weights)


class ML(EvictionPolicy):
    """FlashMoE's learned eviction (see module docstring). ``weights``: a ``.safetensors`` file written by
    ``specmd train-eviction``, or ``specmd:<asset>`` for one shipped with a model (the embedded
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

    **Only the residents are scored, once per step.** A layer's features only change at its next step
    (``on_layer``) and by the uses of its experts, which only its own call makes and which all come before
    the call's first victim search (above); so ``on_layer`` marks the layer dirty and a use does not need
    to. A victim search first re-scores each dirty layer's *resident* experts (usually the running layer's
    few), a key inserted into a clean layer is scored at its insert, and the residents are ranked by
    ``(-distance, key)`` in a :class:`~.structures.KeyHeap` (``set_score``): the largest predicted distance
    first, ties to the lower key. The network is evaluated one row at a time in C (:meth:`distance`), in
    float64 from the float32 features and weights (SiLU as ``z / (1 + exp(-z))``): the same bits compiled
    and as pure Python, and independent of how many rows are scored together (a batched float32 matmul's
    rows are not). ``test_ml_victims_equal_rescoring_from_scratch`` checks every choice against re-scoring
    every candidate from scratch. (Compiled, an extension type, ``ml.pxd``.)"""

    name = "ml"
    Params = MLParams  # (module-level: an extension type's body holds no class statement)

    def __init__(self, params=None):
        super().__init__(params or type(self).Params())
        self._heap = KeyHeap()  # the resident keys by (-distance, key)
        self._shape([], 0)

    def _shape(self, nets: list, experts: int):
        """The per-layer state, and the networks' weights as float64 [layers, ...] stacks (placeholders of
        one layer, one unit until ``attach`` loads them)."""
        L, E = max(len(nets), 1), max(experts, 1)
        H = nets[0]["w1"].shape[0] if nets else 1
        self.E, self.H = experts, H
        self.step = np.zeros(L, dtype=np.int64)  # layer -> its steps so far
        self.fmax = np.zeros(L)  # layer -> max f over its experts
        self.last = np.full((L, E), -1, dtype=np.int64)  # [layer, expert] -> its last routed step (-1: never)
        self.freq = np.zeros((L, E))  # [layer, expert] -> f, its routed steps
        self._dirty = np.ones(L, dtype=np.int64)  # layer -> 1 while its residents' scores are stale
        self._resident = np.zeros(L, dtype=np.int64)  # layer -> its resident keys
        nets = nets or [{"w1": np.zeros((H, 2)), "b1": np.zeros(H), "w2": np.zeros((H, H)), "b2": np.zeros(H),
                         "w3": np.zeros((1, H)), "b3": np.zeros(1)}]
        # flat float64 arrays (``array``: a C buffer compiled, and indexed fast as Python floats run as source;
        # _forward indexes them by offset)
        stack = lambda name, f: np.ascontiguousarray(  # noqa: E731
            np.stack([f(np.asarray(n[name], np.float64)) for n in nets]).reshape(-1))
        self._w1 = stack("w1", lambda a: a.T)  # [L, 2, H]: input-major, as x @ W1
        self._w2 = stack("w2", lambda a: a.T)  # [L, H in, H out]
        self._w3 = stack("w3", lambda a: a[0])  # [L, H]
        self._b1 = stack("b1", lambda a: a)  # [L, H]
        self._b2 = stack("b2", lambda a: a)  # [L, H]
        self._b3 = stack("b3", lambda a: a[0])  # [L]
        self._h1 = np.zeros(H)  # the hidden activations of the row being scored
        self._h2 = np.zeros(H)
        self._x = array("f", [0.0, 0.0])  # its features, rounded to float32 as the training set's

    def attach(self, view, capacity):
        super().attach(view, capacity)
        nets, meta = load_networks(self.params.weights)
        geom = view.geometry
        if len(nets) != geom.num_layers:
            raise ConfigError(f"eviction=ml: weights {self.params.weights!r} have {len(nets)} layers, the model "
                              f"has {geom.num_layers} MoE layers; train matching ones with specmd train-eviction")
        self._shape(nets, geom.num_experts)

    def _layer(self, key: int) -> int:
        """``key``'s layer: an IndexError for a key outside the model (never a stray write compiled)."""
        layer = key // self.E if self.E > 0 else -1
        if layer < 0 or layer >= self._dirty.shape[0]:
            raise IndexError(f"eviction=ml: key {key} outside the model's {self._dirty.shape[0]} layers")
        return layer

    def on_layer(self, layer, record=None):
        if not 0 <= layer < self._dirty.shape[0]:
            raise IndexError(f"eviction=ml: MoE layer {layer} outside the model's {self._dirty.shape[0]}")
        self.step[layer] += 1
        self._dirty[layer] = 1

    def _use(self, key: int):
        layer = self._layer(key)
        e = key - layer * self.E
        self.last[layer, e] = self.step[layer]
        f = self.freq[layer, e] + 1
        self.freq[layer, e] = f
        if f > self.fmax[layer]:
            self.fmax[layer] = f

    def on_miss(self, key):
        self._use(key)

    def on_access(self, key: int):
        self._use(key)

    def on_insert(self, key: int, prefetch: bool):
        layer = self._layer(key)
        self._resident[layer] += 1
        # a dirty layer's keys are scored before the next search ranks them; a clean one's features stand
        self._heap.set_score(key, 0.0 if self._dirty[layer] else -self.distance(layer, key - layer * self.E))

    def on_remove(self, key: int):
        layer = self._layer(key)
        self._heap.remove(key)
        self._resident[layer] -= 1

    def victim(self, evictable):
        heap: KeyHeap = self._heap
        for layer in range(self._dirty.shape[0]):
            if self._dirty[layer] and self._resident[layer] > 0:
                base = layer * self.E
                for e in range(self.E):
                    if heap.contains(base + e):
                        heap.set_score(base + e, -self.distance(layer, e))
                self._dirty[layer] = 0
        return heap.first(evictable)

    def row(self, layer: int, expert: int) -> tuple:
        """``expert``'s features in ``layer`` now, ``(1/r, f / max f)`` rounded to float32 (:func:`features`)."""
        self._features(layer, expert)
        return float(self._x[0]), float(self._x[1])

    def _features(self, layer: int, expert: int):
        """:meth:`row` into ``_x`` (the network's input)."""
        if not (0 <= layer < self._dirty.shape[0] and 0 <= expert < self.E):
            raise IndexError(f"eviction=ml: layer {layer}, expert {expert} outside the model's "
                             f"{self._dirty.shape[0]} x {self.E}")
        s = self.last[layer, expert]
        x0 = 0.0
        x1 = 0.0
        if s >= 0:
            x0 = 1.0 / max(self.step[layer] - s + 1, 1)
        if self.fmax[layer] > 0:
            x1 = self.freq[layer, expert] / self.fmax[layer]
        self._x[0] = x0
        self._x[1] = x1

    def distance(self, layer: int, expert: int) -> float:
        """``expert``'s predicted next-use distance in ``layer`` now (its network on :meth:`row`)."""
        self._features(layer, expert)
        return self._forward(layer)

    def _forward(self, layer: int) -> float:
        """The network of ``layer`` on the features in ``_x``: h1 = SiLU(x W1 + b1), h2 = SiLU(h1 W2 + b2),
        out = h2 W3 + b3, each sum in input order. (The weights are flat arrays indexed by offset, and the
        inner loop runs over contiguous outputs, which the C compiler vectorises.)"""
        H = self.H
        w1 = self._w1
        w2 = self._w2
        w3 = self._w3
        b1 = self._b1
        b2 = self._b2
        h1 = self._h1
        h2 = self._h2
        x0 = self._x[0]
        x1 = self._x[1]
        low = -EXP_MAX  # (a C double: the global is a Python float)
        o1 = layer * 2 * H  # w1 [L, 2, H]
        ob = layer * H  # b1, b2, w3 [L, H]
        o2 = layer * H * H  # w2 [L, H in, H out]
        for j in range(H):  # h1 [H] = SiLU(b1 + x0 w1[0] + x1 w1[1])
            z = b1[ob + j] + x0 * w1[o1 + j] + x1 * w1[o1 + H + j]
            h1[j] = z / (1.0 + exp(-z)) if z > low else 0.0
        for j in range(H):  # h2 [H] = b2 + sum_i h1[i] w2[i]
            h2[j] = b2[ob + j]
        for i in range(H):
            a = h1[i]
            for j in range(H):
                h2[j] += a * w2[o2 + i * H + j]
        out = self._b3[layer]
        for j in range(H):  # out = b3 + sum_j SiLU(h2[j]) w3[j]
            z = h2[j]
            if z > low:
                out += z / (1.0 + exp(-z)) * w3[ob + j]
        return out


EVICTION.register(ML)
