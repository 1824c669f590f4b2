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
    """One MoE layer call, as the engine and the policies see it, whichever driver made it.

    The router's own output comes from the subclass: :class:`LiveRecord` (the live hook's tensors) or
    :class:`specmd.replay.driver.TraceRecord` (rows of a trace, read on first use):

    * ``original`` [T, k] / ``original_weights`` [T, k]: the router's own selection and its weights;
    * ``logits`` [T, E]: the router's logits (:class:`NoLogits` when the trace did not record them);
    * ``tokens`` / ``top_k``; ``prefetch_signal(target)``: MoE layer ``target``'s router applied to this
      call's router input, ``(logits [T, E], its own top-k index [T, k])``.

    Here: ``index`` [T, k] / ``weights`` [T, k], what will run (the router's own until a routing policy
    replaces them: :meth:`Engine.route <specmd.engine.Engine.route>` assigns them); ``void`` [T, k] bool or
    None, slots the routing policy declared empty (:meth:`RoutingPolicy.empties`: not run, not faithful);
    ``probs`` [T, E], derived from the logits on first use; ``call``, the position of this call in the run's
    stream of layer calls (the engine numbers them); ``predict(target)``, the prefetch signal as
    ``(probs, index)``.
    (A compiled extension type: ``record.pxd`` declares these fields, so the engine reads them in C.)
    """

    def __init__(self, layer: int, scoring: Scoring, signal: Optional[Callable] = None,
                 requested: Optional[list] = None):
        """``signal(target)``: the raw prefetch signal ``(logits, index)`` (None: this call has none);
        ``requested``: the experts the router's own selection requests, when the driver knows them."""
        fill(self, layer, scoring, signal, requested)

    # what runs: the router's own selection unless a routing policy replaced it
    @property
    def index(self) -> torch.Tensor:
        return self.original if self._index is None else self._index

    @index.setter
    def index(self, value: torch.Tensor) -> None:
        self._index = value

    @property
    def weights(self) -> torch.Tensor:
        return self.original_weights if self._weights is None else self._weights

    @weights.setter
    def weights(self, value: torch.Tensor) -> None:
        self._weights = value

    @property
    def rerouted(self) -> bool:
        """True once a routing policy replaced the router's selection."""
        return self._index is not None and self._index is not self.original

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = self.scoring.probs(self.logits)
        return self._probs

    def probs_rows(self):
        """``probs`` as a float32 numpy array [T, E] on the host, for a policy that reads probabilities in
        a loop of its own (``eviction=score``): read it, never write it (it may be shared). A replay answers
        it from probabilities computed a chunk of calls at a time (the same bits: tested)."""
        return self.probs.detach().float().cpu().numpy()

    @property
    def slots(self) -> int:
        """Token-expert selections of this call (tokens x k), computed once (``_slots``: -1 until then)."""
        if self._slots < 0:
            self._slots = self.tokens * self.top_k
        return self._slots

    def requested(self, num_experts: int):
        """The experts this call's selection (``index``) requests, ascending."""
        if self.rerouted:
            return _unique(self._index, num_experts)
        if self._requested is None:
            self._requested = _unique(self.original, num_experts)
        return self._requested

    def prefetch_signal(self, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, E], index [T, k])`` of MoE layer ``target``'s router on this call's router input."""
        if self._signal is None:
            raise NoLogits(f"no prefetch signal for MoE layer {target} in this layer call")
        return self._signal(target)

    def predict(self, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefetch signal as ``(probs [T, E], index [T, k])``."""
        logits, index = self.prefetch_signal(target)
        return self.scoring.probs(logits), index

    def reweigh(self, index: torch.Tensor) -> torch.Tensor:
        """Dual-logit semantics: weights of a (modified) selection from the *original* probabilities."""
        return self.scoring.weigh(self.probs, index).to(self.weights.dtype)


def fill(rec: GateRecord, layer: int, scoring, signal, requested) -> GateRecord:
    """A new record's own fields (what ``GateRecord.__init__`` does; a driver that allocates its records
    without a constructor call fills them here)."""
    rec.layer = layer
    rec.call = -1
    rec.scoring = scoring
    rec.void = None
    rec._slots = -1
    rec._index = rec._weights = rec._probs = None
    rec._requested = requested
    rec._signal = signal
    return rec


class LiveRecord(GateRecord):
    """A layer call whose router output is in memory: the live hook's (and hand-made ones in tests).
    ``logits`` [T, E] or None (then policies that read them raise :class:`NoLogits`)."""

    __slots__ = ("original", "original_weights", "_logits")

    def __init__(self, layer: int, logits: Optional[torch.Tensor], weights: torch.Tensor, index: torch.Tensor,
                 scoring: Scoring, signal: Optional[Callable] = None):
        super().__init__(layer, scoring, signal)
        self.original = index
        self.original_weights = weights
        self._logits = logits

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            raise NoLogits("this layer call has no router logits (the trace did not record them); the stack needs "
                           "router probabilities")
        return self._logits

    @property
    def tokens(self) -> int:
        return self.original.shape[0]

    @property
    def top_k(self) -> int:
        return self.original.shape[-1]


SMALL_SELECTION = 256  # token-expert slots up to which the requested experts are found in Python


def _unique(index: torch.Tensor, num_experts: int) -> list[int]:
    """The distinct experts of ``index``, ascending. A decode call selects a handful (k per token): a
    Python set of its ``tolist()`` costs ~3 us where the four torch ops of the bincount cost ~30 on a CPU,
    once per layer call of a live run (issue 20's hook overhead). Same list either way (tested)."""
    if index.numel() <= SMALL_SELECTION:
        return sorted(set(index.reshape(-1).tolist()))
    return torch.bincount(index.reshape(-1), minlength=num_experts).nonzero().squeeze(1).tolist()
