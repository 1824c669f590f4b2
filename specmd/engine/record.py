"""The gate record: what one MoE layer call tells the engine (SpecMD App. A.1). No policy knows a family
or which driver (live hook or trace replay) made the record."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import ConfigError


class Scoring:
    """How a family turns router logits into probabilities and top-k weights (from its adapter)."""

    __slots__ = ("sigmoid", "renorm", "scale")

    def __init__(self, sigmoid: bool, renorm: bool, scale: float):
        self.sigmoid = sigmoid
        self.renorm = renorm
        self.scale = scale

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)

    def weigh(self, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        w = probs.gather(-1, index)
        if self.renorm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            w = w * self.scale
        return w

    def to_dict(self) -> dict:
        return {"sigmoid": self.sigmoid, "renorm": self.renorm, "scale": self.scale}


class NoLogits(ConfigError):
    """A policy needs router probabilities (or the prefetch signal) that the trace did not record."""


class GateRecord:
    """One MoE layer call.

    ``index`` [T, k] / ``weights`` [T, k]: what will run (routing policies replace them); ``original`` /
    ``original_weights``: the router's own selection; ``void`` [T, k] bool or None: slots the routing policy
    declared empty (:meth:`RoutingPolicy.empties`: not run, not faithful). ``logits`` [T, E] (None for traces that did not record
    them); ``probs`` [T, E] is derived on first use. ``call``: the position of this call in the run's stream
    of layer calls (the engine numbers them). ``predict(target)``: the prefetch signal, i.e. MoE layer
    ``target``'s router applied to this call's router input: ``(probs [T, E], its own top-k index [T, k])``
    (live: computed from the model; replay: read from the trace).
    """

    __slots__ = ("layer", "call", "logits", "weights", "index", "original", "original_weights", "scoring",
                 "void", "_probs", "_requested", "_signal")

    def __init__(self, layer: int, logits: Optional[torch.Tensor], weights: torch.Tensor, index: torch.Tensor,
                 scoring: Scoring, signal: Optional[Callable] = None):
        self.layer = layer
        self.call = -1
        self.logits = logits
        self.weights = weights
        self.index = index
        self.original = index  # the router's own selection (routing policies replace ``index``)
        self.original_weights = weights
        self.scoring = scoring
        self.void = None
        self._probs = None
        self._requested = None
        self._signal = signal

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            if self.logits is None:
                raise NoLogits("this layer call has no router logits (the trace did not record them); the "
                               "stack needs router probabilities")
            self._probs = self.scoring.probs(self.logits)
        return self._probs

    @property
    def tokens(self) -> int:
        return self.index.shape[0]

    @property
    def slots(self) -> int:
        """Token-expert selections of this call (tokens x k)."""
        return self.index.numel()

    @property
    def rerouted(self) -> bool:
        """True once a routing policy replaced the router's selection."""
        return self.index is not self.original

    @property
    def top_k(self) -> int:
        return self.index.shape[-1]

    def requested(self, num_experts: int) -> list[int]:
        """The experts this call's selection (``index``) requests, ascending."""
        if self.index is self.original:
            if self._requested is None:
                self._requested = _unique(self.index, num_experts)
            return self._requested
        return _unique(self.index, num_experts)

    def predict(self, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._signal is None:
            raise NoLogits(f"no prefetch signal for MoE layer {target} in this layer call")
        return self._signal(target)

    def reweigh(self, index: torch.Tensor) -> torch.Tensor:
        """Dual-logit semantics: weights of a (modified) selection from the *original* probabilities."""
        return self.scoring.weigh(self.probs, index).to(self.weights.dtype)


def _unique(index: torch.Tensor, num_experts: int) -> list[int]:
    return torch.bincount(index.reshape(-1), minlength=num_experts).nonzero().squeeze(1).tolist()
