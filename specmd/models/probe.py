"""Steps 3 to 5 of the probe (:mod:`specmd.models.derive`) on a family's tiny instance: how its router is called
(:func:`router_args`, :func:`call`, :func:`route`; identity experts past E: :func:`identity_attr`), how its
weights follow from its first output (:func:`weights_rule`: a score of :data:`SCORES`, renormalised or not,
scaled), where its selection bias is (:func:`bias_place`), whether its experts compute what specmd's kernel does
(:func:`kernel_agrees`), and the group rule under which its top-k is the selection score's (:func:`selection`).
Each refuses the family with :class:`~specmd.models.tiny.Refuse`, naming what does not fit."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..errors import ConfigError
from .family import TOKEN_IDS, TokenIds
from .tiny import SCALE_FIELDS, TOP_K, Refuse, build, text_field

IDENTITY_FIELDS = ("zero_expert_num",)  # where configs keep the identity experts' count (router columns past E)
GROUP_SCORES = ("top2", "max")
GROUP_FILLS = (float("-inf"), 0.0)  # what a left-out group scores (transformers' DeepSeek-V3; A.X-K2)
SCORES = ("softmax", "sigmoid", "sqrtsoftplus", "probabilities")  # Adapter.score: what the router's first output is taken through


def router_args(router, block) -> tuple:
    """The block attributes the router's forward takes after the hidden states (``Adapter.router_args``):
    each further parameter of its signature that the block holds as a tensor; () when it takes the hidden
    states alone. A parameter the block does not hold is refused."""
    import inspect

    import torch

    params = [p for p in list(inspect.signature(router.forward).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def held(name):  # (the pass's token ids are the hook's to give: a hash-routed router, Adapter.router_call)
        return name == TOKEN_IDS or isinstance(getattr(block, name, None), torch.Tensor)

    # the required ones, and an optional one the block holds (LFM2-MoE: gate(hidden, expert_bias) where it has one)
    last = max((i + 1 for i, p in enumerate(params) if held(p.name) or p.default is inspect.Parameter.empty), default=0)
    names = tuple(p.name for p in params[:last] if p.name != TOKEN_IDS)
    lacking = [n for n in names if not held(n)]
    if lacking:
        raise Refuse(f"its router needs more than the hidden states ({', '.join(lacking)}, which its MoE block does "
                      f"not hold)")
    return names


PROBE_TOKENS = TokenIds()  # the probe's token ids (a hash-routed router reads them): one per hidden row


def call(adapter, model, layer_id: int):
    """The layer's router as its block calls it, given the probe's token ids."""
    return adapter.router_call(model, layer_id, PROBE_TOKENS)


def route(router, hidden):
    """``router(hidden)`` (a module's forward, or an ``Adapter.router_call``): (logits, weights, index)."""
    import torch

    try:
        with torch.no_grad():
            out = router(hidden)
    except Exception as exc:  # noqa: BLE001 -- a router that needs more than the hidden states
        raise Refuse(f"its router needs more than the hidden states ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]})") from None
    if not isinstance(out, tuple) or len(out) != 3:
        n = len(out) if isinstance(out, tuple) else 1
        raise Refuse(f"its router returns {n} value(s), not (logits, weights, index)")
    return out


def _fit(logits, weights, index, expert_scale=None):
    """(score, renorm, scale) whose ``Scoring.weigh`` gives the router's weights, or None: ``score`` "softmax"
    or "sigmoid" of its first output, or "probabilities" (the output is its probabilities: Gemma-4);
    ``expert_scale`` [E]: a per-expert factor the weights carry besides (divided out first)."""
    import torch

    from ..engine.record import Scoring

    if expert_scale is not None:
        weights = weights.float() / expert_scale.detach().float()[index]
    for score in SCORES:
        for renorm in (True, False):
            s = Scoring(score == "sigmoid", renorm, 1.0, given=score == "probabilities",
                        sqrt_softplus=score == "sqrtsoftplus")
            ratio = weights.float() / s.weigh(s.probs(logits), index).clamp_min(1e-30)
            c = float(ratio.mean())
            if math.isfinite(c) and torch.allclose(ratio, torch.full_like(ratio, c), rtol=1e-4, atol=1e-6):
                return score, renorm, c
    return None


def _weight_scales(router, E: int, bias_attr: str) -> list:
    """The router's ``[E]`` float parameters other than a selection bias: candidates for a learned per-expert
    weight scale (Gemma-4's ``per_expert_scale``), set to random values in the probe so that one shows."""
    import torch

    g = torch.Generator().manual_seed(3)
    found = []
    for name, p in router.named_parameters(recurse=False):
        if p.dim() == 1 and p.numel() == E and p.is_floating_point() and name != bias_attr:
            with torch.no_grad():
                p.copy_(torch.rand(E, generator=g) + 0.5)
            found.append(name)
    return found


def bias_place(probe, model, layer: int, E: int) -> dict:
    """``bias_attr`` and ``bias_path``: where the layer's selection bias is -- an ``[E]`` tensor the block passes
    its router (LFM2-MoE's ``expert_bias``), else ``probe.bias_attr`` in the router or in a submodule of it
    (ERNIE-4.5's ``moe_statics``)."""
    block = probe.block(model, layer)
    bias_attr = next((n for n in probe.router_args if "bias" in n and getattr(block, n).shape == (E,)), probe.bias_attr)
    router = probe.router(model, layer)
    nested = [n.rsplit(".", 1)[0] for n, _ in (*router.named_buffers(), *router.named_parameters())
              if n.endswith("." + bias_attr)]
    return dict(bias_attr=bias_attr, bias_path=nested[0] if nested else "")


def identity_attr(config, E: int, width: int) -> Optional[str]:
    """The config field holding the count of identity experts, router columns past the E experts with weights
    (:data:`IDENTITY_FIELDS`: LongCat-Flash's ``zero_expert_num``), or None where the router has E columns.
    Refused: more columns than any field explains."""
    if width == E:
        return None
    attr = next((f for f in IDENTITY_FIELDS if getattr(config, f, None) == width - E), None)
    if attr is None:
        raise Refuse(f"its router scores {width} columns for {E} experts, and no config field of "
                      f"{', '.join(IDENTITY_FIELDS)} holds the {width - E} others")
    return attr


def spread_routers(adapter, model, moe: list, E: int) -> None:
    """Every router's projection to its experts (a ``weight`` [E, H]) drawn at random, logits of unit spread: a
    router initialised to zeros (AfMoE's) scores every expert alike, and then a softmax fits a sigmoid
    router's weights."""
    import torch

    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for i in moe:
            for name, p in adapter.router(model, i).named_parameters():
                if name.endswith("weight") and p.dim() == 2 and p.shape[0] == E and p.is_floating_point():
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def weights_rule(family: str, over: dict, probe, model, moe: list, E: int, hidden) -> dict:
    """The Adapter fields of how the router's weights follow from its first output: ``score``, ``renorm``
    (a ``norm_topk_prob`` field where flipping it flips the fit), ``scale_attr`` (the config field of a
    constant factor, :data:`SCALE_FIELDS`), ``weight_scale_attr`` (a learned per-expert factor)."""
    from .family import Adapter

    config = Adapter.text(model.config)
    router = probe.router(model, moe[0])
    scales = [_weight_scales(probe.router(model, i), E, probe.bias_attr) for i in moe]  # (every layer's drawn)
    scales = scales[0]  # the names: the first layer's
    logits, weights, index = route(call(probe, model, moe[0]), hidden)
    weight_scale_attr, fit = None, _fit(logits, weights, index)
    for name in scales if fit is None else ():  # weights that carry a learned per-expert scale
        fit = _fit(logits, weights, index, getattr(router, name))
        if fit is not None:
            weight_scale_attr = name
            break
    if fit is None:
        raise Refuse("its router's weights are no softmax or sigmoid of its logits (or its first output), "
                      "renormalised or scaled")
    score, renorm, c = fit
    scale_attr = None
    if abs(c - 1.0) > 1e-4:
        scale_attr = next((f for f in SCALE_FIELDS if abs(float(getattr(config, f, math.nan)) - c) < 1e-4), None)
        if scale_attr is None:
            raise Refuse(f"its router scales the weights by {c:.4g}, which no config field holds")
    if isinstance(getattr(config, "norm_topk_prob", None), bool):  # does the field decide the renormalisation?
        flip = {"norm_topk_prob": not config.norm_topk_prob}
        field = text_field(model.config)  # (a wrapper's: the flag is its text decoder's)
        flipped = build(family, dict(over, **{field: dict(over[field], **flip)}) if field else dict(over, **flip))
        spread_routers(probe, flipped, moe, E)
        fit2 = _fit(*route(call(probe, flipped, moe[0]), hidden),
                    getattr(probe.router(flipped, moe[0]), weight_scale_attr) if weight_scale_attr else None)
        if fit2 is not None and fit2[1] != renorm:
            renorm = "norm_topk_prob" if renorm == config.norm_topk_prob else None
            if renorm is None:
                raise Refuse("its renormalisation is the opposite of its norm_topk_prob field")
    return dict(score=score, renorm=renorm, scale_attr=scale_attr, weight_scale_attr=weight_scale_attr)


def kernel_agrees(experts, layout, E: int, hidden, width: Optional[int] = None):
    """``layout``, its own loop set where the module's forward adds its experts in ascending id (Step-3.7's,
    MuSe-Spark's), such that the experts module computes what specmd's experts kernel
    (:func:`~specmd.executor.kernel.run_experts`, the offload executor's) computes from its weights, bit for
    bit -- transformers' fused experts do, through ``use_experts_implementation`` -- or the family is refused:
    offloaded would not equal simulated. ``width``: the router's columns (identity experts' ids past E, chosen
    too)."""
    import torch

    from ..executor.kernel import expert_tensors, run_experts, views_of

    g = torch.Generator().manual_seed(2)
    index = torch.stack([torch.randperm(width or E, generator=g)[:TOP_K] for _ in range(hidden.shape[0])])  # [T, k]
    weights = torch.rand(index.shape, generator=g)
    try:
        with torch.no_grad():
            own = experts(hidden, index, weights)
            sources = views_of(expert_tensors(experts, E), E)
            for candidate in (layout, dataclasses.replace(layout, own_loop=True),
                              dataclasses.replace(layout, input_weighted=True)):
                mine = run_experts(experts, candidate, hidden, index, weights, sources)
                if torch.equal(own, mine):
                    return candidate
    except Exception as exc:  # noqa: BLE001 -- experts that take more than the decoder's hidden states
        raise Refuse(f"its experts are not called as experts(hidden [T, H], index, weights) ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]})") from None
    raise Refuse("its experts module computes other than specmd's experts kernel, summed in rank order or in its own "
                  f"loop's (max difference {float((own - mine).abs().max()):.2g}): offloaded would not equal simulated")


def selection(adapter, model, moe, hidden):
    """``adapter`` with the group rule whose selection reproduces every router's top-k under a random
    selection bias (on each router that holds one)."""
    import torch

    holders = [adapter.bias_holder(model, i) for i in moe]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for h in holders:
            bias = getattr(h, adapter.bias_attr, None)
            if isinstance(bias, torch.Tensor):  # scores mostly negative: filling left-out groups with 0.0 or -inf
                bias.copy_(torch.rand(bias.shape, generator=g) * 0.5 - 1.0)  # then selects differently: both fitted
    routed = [route(call(adapter, model, i), hidden) for i in moe]
    grouped = (getattr(adapter.text(model.config), "n_group", 1) or 1) > 1
    groups = [(g, fill) for g in GROUP_SCORES for fill in GROUP_FILLS] + [(None, GROUP_FILLS[0])] if grouped else \
        [(None, GROUP_FILLS[0])]  # (a router may ignore the groups)
    for (group_score, fill), on_logits in ((rule, on) for on in (False, True) for rule in groups):
        candidate = dataclasses.replace(adapter, group_score=group_score, group_fill=fill, bias_on_logits=on_logits)
        try:
            scoring = candidate.scoring(model.config, holders, candidate.hashed(model))
        except (ConfigError, ValueError) as exc:
            raise Refuse(f"its group limit does not fit ({exc})") from None
        k = routed[0][2].shape[-1]
        if all(_same_sets(scoring.select(lg, l, k, idx), idx) for l, (lg, _, idx) in enumerate(routed)):
            return candidate
    raise Refuse("its top-k is not the top-k of its probabilities (or logits) plus a selection bias within a group "
                  "limit (left-out groups scored -inf or 0.0)")


def _same_sets(a, b) -> bool:
    return bool((a.sort(-1).values == b.sort(-1).values).all())
