"""The gate record: what one MoE layer call tells the engine (SpecMD App. A.1). No policy knows a family
or which driver (live hook or trace replay) made the record."""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Callable, Optional

import torch

from ..errors import ConfigError


GROUP_SCORES = ("top2", "max")  # how a group-limited router scores a group of experts (see Scoring)


class Scoring:
    """A family's routing rule, as the engine and the policies use it (built by its adapter from the loaded
    model, stored in a trace's ``meta.json``): how router logits become **router probabilities** and top-k
    **weights** (what the model weighs experts' outputs by), and how it **selects** its top-k (the
    **selection score**, which every policy that ranks experts ranks by).

    * ``sigmoid``: probabilities are ``sigmoid(logits)`` (DeepSeek-V3 and its kind), else ``softmax``;
    * ``renorm`` / ``scale``: the top-k weights are the selected probabilities, renormalised to sum 1 when
      ``renorm``, times ``scale`` (``routed_scaling_factor``);
    * ``bias``: ``[L, E]`` float32 or None, a per-MoE-layer **selection bias** added to the probabilities
      for choosing, never for weighing (DeepSeek-V3's ``e_score_correction_bias``: "the bias term is only used
      for routing", DeepSeek-V3 report §2.1.2);
    * ``groups`` / ``topk_group`` / ``group_score``: group-limited top-k (DeepSeek-V2's device-limited
      routing, V3's node-limited routing): the E experts form ``groups`` equal groups, each token keeps the
      ``topk_group`` best groups -- a group scored by the sum of its two best selection scores (``top2``,
      DeepSeek-V3's router) or its best one (``max``, DeepSeek-V2's ``group_limited_greedy``) -- and selects
      its top-k among their experts. ``groups = 1`` (or ``topk_group >= groups``): no limit.

    * ``given``: the router's first output already *is* its probabilities (Gemma-4's router returns its
      softmax, not its logits): probabilities are that output as it is, and a trace's ``logits`` hold them;
    * ``expert_scale``: ``[L, E]`` float32 or None, a learned per-expert factor on the top-k weights after
      renormalisation (Gemma-4's ``per_expert_scale``: "apply per-expert scale directly to the weights", its
      router's code), never on the selection;
    * ``on_logits``: the selection bias is added to the logits, not the probabilities (Kolibri's router:
      ``topk(router_logits + e_score_correction_bias)``), so the selection score is ``logits + bias``;
    * ``group_fill``: what the groups a token leaves out score (``-inf``: transformers' DeepSeek-V3 router,
      never chosen; ``0.0``: A.X-K2's router, which chooses there when every kept score is negative -- its
      code, reproduced, not corrected);
    * ``sqrt_softplus``: probabilities are ``sqrt(softplus(logits))`` (DeepSeek-V4's ``scoring_func``);
    * ``hashed``: the MoE layers (ordinals) whose router's choice is not its scores' top-k but the token's own
      (DeepSeek-V4's first layers: ``tid2eid[input_ids]``, "hash routing", its paper §2.1): there the selection
      score lifts the router's own choice (``chosen``) above every other expert, the rest ranked by the gate's
      probabilities -- a policy that re-scores (Cache-Prior) leaves the token's choice, one that ranks past the
      top-k (max_rank's M > k) takes the gate's next best.

    :meth:`selection` is exactly the family's own router computation (transformers'
    ``DeepseekV3TopkRouter.forward``: ``sigmoid(logits) + bias``, the groups outside the token's best set to
    ``-inf``), so the top-k of the selection score *is* the router's choice (``tests/policies/test_selection.py``
    checks it on every family, biased and group-limited). A rule with neither bias nor groups is ``plain``:
    the selection score is the probabilities themselves, and a ranking reads the logits (the same order).
    """

    __slots__ = ("sigmoid", "renorm", "scale", "bias", "groups", "topk_group", "group_score", "plain", "given",
                 "expert_scale", "group_fill", "on_logits", "_scale_dev", "sqrt_softplus", "hashed")

    def __init__(self, sigmoid: bool, renorm: bool, scale: float, bias: Optional[torch.Tensor] = None,
                 groups: int = 1, topk_group: int = 1, group_score: str = "top2", given: bool = False,
                 expert_scale: Optional[torch.Tensor] = None, group_fill: float = float("-inf"),
                 on_logits: bool = False, sqrt_softplus: bool = False, hashed=()):
        """Errors: ValueError for a ``group_score`` outside :data:`GROUP_SCORES`, groups that do not divide
        the experts, a ``topk_group`` outside 1..groups, a bias or expert scale that is not ``[L, E]`` or not
        finite, a ``group_fill`` other than ``-inf`` or a finite number, a hashed layer that is no
        non-negative integer."""
        self.sigmoid = sigmoid
        self.sqrt_softplus = bool(sqrt_softplus)
        if any(not isinstance(l, int) or isinstance(l, bool) or l < 0 for l in hashed):
            raise ValueError(f"hashed={list(hashed)!r}: MoE layer ordinals (integers >= 0)")
        self.hashed = frozenset(hashed)
        self.given = bool(given)
        self.expert_scale = _layer_table(expert_scale, "per-expert weight scale")
        self._scale_dev = None
        group_fill = float(group_fill)
        if math.isnan(group_fill) or group_fill == float("inf"):
            raise ValueError(f"group_fill={group_fill}: -inf or a finite score")
        self.group_fill = group_fill
        self.on_logits = bool(on_logits)
        self.renorm = renorm
        self.scale = scale
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={group_score!r}; valid: {', '.join(GROUP_SCORES)}")
        groups, topk_group = int(groups), int(topk_group)
        if groups < 1 or not 1 <= topk_group <= groups:
            raise ValueError(f"groups={groups}, topk_group={topk_group}: a router keeps 1..groups of its >= 1 groups")
        if topk_group == groups:  # every group kept: no limit
            groups = topk_group = 1
        bias = _layer_table(bias, "selection bias")
        if bias is not None and not bool(bias.any()):
            bias = None  # all zero: the probabilities rank exactly as they are
        if bias is not None:
            group_errors(groups, group_score, bias.shape[1])
        self.bias = bias
        self.groups = groups
        self.topk_group = topk_group
        self.group_score = group_score
        self.plain = self.bias is None and self.groups == 1 and not self.hashed

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.given:
            return logits
        if self.sqrt_softplus:
            return torch.nn.functional.softplus(logits).sqrt()
        return logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)

    @property
    def elementwise(self) -> bool:
        """Each expert's probability is its logit's alone (no softmax over the row)."""
        return self.sigmoid or self.sqrt_softplus or self.given

    def weigh(self, probs: torch.Tensor, index: torch.Tensor, layer: Optional[int] = None) -> torch.Tensor:
        """``[T, k]``: the weights of experts ``index`` [T, k] from the probabilities ``probs`` [T, E] at MoE
        layer ``layer`` (whose per-expert scale applies; a rule with one needs it: ValueError without). An index
        of E (an empty slot's zero-probability column) takes expert E - 1's scale: its weight is 0 anyway."""
        w = probs.gather(-1, index)
        if self.renorm:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            w = w * self.scale
        if self.expert_scale is not None:
            if layer is None:
                raise ValueError("a per-expert weight scale weighs per MoE layer: weigh(probs, index, layer)")
            w = w * self._scale_on(w.device)[layer][index.clamp_max(self.expert_scale.shape[1] - 1)]
        return w

    def _scale_on(self, device) -> torch.Tensor:
        """The per-expert weight scale ``[L, E]`` on ``device``, copied there once."""
        if self._scale_dev is None or self._scale_dev.device != device:
            self._scale_dev = self.expert_scale.to(device)
        return self._scale_dev

    def selection(self, probs: torch.Tensor, layer: int, chosen: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[T, E]`` float32: MoE layer ``layer``'s selection score of every expert for every token, from its
        router probabilities ``probs`` [T, E]: ``probs + bias[layer]``, ``-inf`` outside the token's
        ``topk_group`` best groups; at a hashed layer the router's own choice ``chosen`` [T, k] (required
        there: ValueError without) lifted above every other expert. ``probs`` itself (no copy) for a plain
        rule: never write the result."""
        if self.plain:
            return probs
        if layer in self.hashed:
            if chosen is None:
                raise ValueError(f"MoE layer {layer} is hash-routed: its selection needs the router's own choice")
            s = probs.float()
            lift = (s.amax() - s.amin() + 1.0).expand(chosen.shape)  # above every unchosen score
            return s.scatter_add(-1, chosen, lift)
        s = probs.float()
        if self.bias is not None:
            s = s + self.bias[layer].to(s.device)
        g = self.groups
        if g > 1:
            T, E = s.shape
            grouped = s.view(T, g, E // g)
            if self.group_score == "top2":
                group = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, g]
            else:
                group = grouped.max(dim=-1).values
            best = torch.topk(group, k=self.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, best, True)
            s = s.masked_fill(~keep.unsqueeze(-1).expand(T, g, E // g).reshape(T, E), self.group_fill)
        return s

    def scores_of(self, logits: torch.Tensor, layer: int, chosen: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[T, E]``: the selection score of router ``logits`` [T, E] at MoE layer ``layer`` (:meth:`selection`
        of the probabilities, or of the logits for a bias added to them; ``chosen``: the router's own choice,
        which a hashed layer's score lifts)."""
        return self.selection(logits.float() if self.on_logits else self.probs(logits), layer, chosen)

    def select(self, logits: torch.Tensor, layer: int, k: int, chosen: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[T, k]``: the top-k the family's router selects from ``logits`` [T, E] at MoE layer ``layer``
        (for a policy that changes the logits, Cache-Prior's ``z'``; ``chosen``: the router's own choice, which
        a hashed layer keeps). A plain rule takes the top-k of the logits (softmax and sigmoid keep their
        order)."""
        if self.plain:
            return torch.topk(logits, k, dim=-1).indices
        return torch.topk(self.scores_of(logits, layer, chosen), k, dim=-1).indices

    def to_dict(self) -> dict:
        out = {"sigmoid": self.sigmoid, "renorm": self.renorm, "scale": self.scale}
        if self.bias is not None:
            out["bias"] = self.bias.tolist()
        if self.groups > 1:
            out.update(groups=self.groups, topk_group=self.topk_group, group_score=self.group_score)
            if self.group_fill != float("-inf"):
                out["group_fill"] = self.group_fill
        if self.given:
            out["given"] = True
        if self.on_logits and self.bias is not None:
            out["on_logits"] = True
        if self.expert_scale is not None:
            out["expert_scale"] = self.expert_scale.tolist()
        if self.sqrt_softplus:
            out["sqrt_softplus"] = True
        if self.hashed:
            out["hashed"] = sorted(self.hashed)
        return out

    @classmethod
    def from_dict(cls, d: dict, layers: Optional[int] = None, experts: Optional[int] = None) -> "Scoring":
        """The inverse of :meth:`to_dict` (a trace's ``meta.json``: an older one has no rule, which reads as
        none). ``layers`` / ``experts``: the bias's expected shape. Errors: ValueError naming the field."""
        if not isinstance(d, dict):
            raise ValueError(f"scoring is a mapping, got {type(d).__name__}")
        bias, expert_scale = (_table_of(d, key, layers, experts) for key in ("bias", "expert_scale"))
        for key in ("scale",):
            if not math.isfinite(float(d.get(key, 1.0))):
                raise ValueError(f"scoring.{key}={d.get(key)!r} is not finite")
        if experts is not None and int(d.get("topk_group", 1)) < int(d.get("groups", 1)):
            group_errors(int(d.get("groups", 1)), str(d.get("group_score", "top2")), experts)
        hashed = d.get("hashed", [])
        if not isinstance(hashed, list) or (layers is not None and any(
                not isinstance(l, int) or not 0 <= l < layers for l in hashed)):
            raise ValueError(f"scoring.hashed={hashed!r}: a list of MoE layer ordinals"
                             f"{f' below {layers}' if layers is not None else ''}")
        return cls(bool(d.get("sigmoid", False)), bool(d.get("renorm", True)), float(d.get("scale", 1.0)), bias,
                   int(d.get("groups", 1)), int(d.get("topk_group", 1)), str(d.get("group_score", "top2")),
                   bool(d.get("given", False)), expert_scale, float(d.get("group_fill", float("-inf"))),
                   bool(d.get("on_logits", False)), bool(d.get("sqrt_softplus", False)), hashed)


def _layer_table(t, what: str) -> Optional[torch.Tensor]:
    """``t`` as a ``[L, E]`` float32 host tensor (None stays None). Errors: ValueError naming ``what``."""
    if t is None:
        return None
    t = torch.as_tensor(t, dtype=torch.float32).detach().cpu()
    if t.dim() != 2:
        raise ValueError(f"a {what} is [MoE layers, experts], got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"the {what} has non-finite values")
    return t


def _table_of(d: dict, key: str, layers: Optional[int], experts: Optional[int]) -> Optional[torch.Tensor]:
    """A trace's ``scoring.<key>`` table as a tensor, checked against the geometry (``layers`` x ``experts``)."""
    table = d.get(key)
    if table is None:
        return None
    try:
        table = torch.tensor(table, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"scoring.{key} is not a [layers, experts] table of numbers ({e})") from None
    if layers is not None and tuple(table.shape) != (layers, experts):
        raise ValueError(f"scoring.{key} has shape {tuple(table.shape)}; the geometry has {layers} MoE layers "
                         f"of {experts} experts")
    return table


def group_errors(groups: int, group_score: str, experts: int) -> None:
    """A group limit ``experts`` can hold: ``groups`` divides them, and a ``top2`` group has two. Errors:
    ValueError naming the values."""
    if groups > 1 and (experts % groups or (group_score == "top2" and experts // groups < 2)):
        raise ValueError(f"groups={groups} with group_score={group_score!r}: {experts} experts do not form {groups} "
                         f"equal groups{' of at least 2' if group_score == 'top2' else ''}")


class Routed:
    """A routing policy's answer for one layer call (:meth:`RoutingPolicy.route
    <specmd.policies.routing.base.RoutingPolicy.route>`), the one value the policy and the engine exchange:
    ``index`` [T, k] long, the experts to run; ``weights`` [T, k], what each runs with (dual-logit: the
    original router probabilities, the family's way: ``GateRecord.reweigh``); ``void`` [T, k] bool or None,
    the slots the policy emptied (they run nothing and count neither as device work nor as faithful)."""

    __slots__ = ("index", "weights", "void")

    def __init__(self, index: torch.Tensor, weights: torch.Tensor, void: Optional[torch.Tensor] = None):
        self.index = index
        self.weights = weights
        self.void = void


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
    None, slots the routing policy declared empty (:attr:`Routed.void`: not run, not faithful);
    ``probs`` [T, E], derived from the logits on first use (what weights are made of); ``scores`` [T, E], the
    family's selection score (what policies rank by: :meth:`Scoring.selection`); ``call``, the position of this
    call in the run's stream of layer calls (the engine numbers them); ``predict(target)``, the prefetch signal as
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

    @property
    def scores(self) -> torch.Tensor:
        """``[T, E]``: the family's **selection score** (:meth:`Scoring.selection`: the probabilities plus the
        layer's selection bias, ``-inf`` outside the token's groups), what every policy that ranks experts
        ranks by; the router's own top-k is its top-k. ``probs`` itself for a plain rule. Read, never write."""
        if self._scores is None:
            s = self.scoring
            self._scores = s.selection(self.logits.float() if s.on_logits and not s.plain else self.probs, self.layer,
                                       self.original)
        return self._scores

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
        return self.scoring.weigh(self.probs, index, self.layer).to(self.weights.dtype)


def fill(rec: GateRecord, layer: int, scoring, signal, requested) -> GateRecord:
    """A new record's own fields (what ``GateRecord.__init__`` does; a driver that allocates its records
    without a constructor call fills them here)."""
    rec.layer = layer
    rec.call = -1
    rec.scoring = scoring
    rec.void = None
    rec._slots = -1
    rec._index = rec._weights = rec._probs = rec._scores = None
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
    """The distinct experts of ``index`` below ``num_experts``, ascending (an id from ``num_experts`` on is an
    identity expert's, :attr:`~specmd.engine.geometry.Geometry.identity_experts`: nothing to serve). A decode
    call selects a handful (k per token): a Python set of its ``tolist()`` costs ~3 us where the four torch ops
    of the bincount cost ~30 on a CPU, once per layer call of a live run (issue 20's hook overhead). Same list
    either way (tested)."""
    if index.numel() <= SMALL_SELECTION:
        out = sorted(set(index.reshape(-1).tolist()))
        if out and out[-1] >= num_experts:
            del out[bisect_left(out, num_experts):]
        return out
    return expert_counts(index, num_experts).nonzero().squeeze(1).tolist()


def expert_counts(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]``: the selections of each expert in ``index``; an id from ``num_experts`` on (an identity expert's)
    is left out -- sliced off only where there is one, so no op is added otherwise (the hot path's count)."""
    counts = torch.bincount(index.reshape(-1), minlength=num_experts)
    return counts[:num_experts] if counts.shape[0] > num_experts else counts
