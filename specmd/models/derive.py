"""Families derived from transformers' own classes: a model family the installed transformers ships, that no
record in :data:`~specmd.models.adapters.ADAPTERS` describes, is read off a tiny random instance of its own
config class -- where its MoE blocks are, which module routes, how the router's weights follow from its
logits, what selection rule picks its top-k, what its fused experts compute -- and runs with the
:class:`~specmd.models.family.Adapter` so derived, or is refused with the reason.

A family that follows transformers 5's MoE contract needs no record at all: decoder layers at
``model.model.layers``, the block one attribute of a layer (``mlp``; ``block_sparse_moe``, ``feed_forward``,
``mixer`` elsewhere: ``Adapter.block_attr``) with a router (``gate`` or ``router``) whose
``forward(hidden [T, H])`` returns ``(logits [T, E], weights [T, k], index [T, k])`` and fused experts
(``experts(hidden, index, weights)``, ``[E, ...]`` parameters, the flags ``use_experts_implementation`` sets),
and an ``lm_head`` (the final norm wherever the decoder keeps it). What the probe reads, in order (each step's
failure is the reason a family is refused, one line naming what it lacks):

1. the family has a causal-LM class, and its config class builds shrunk (:data:`SHRINK`; lists per layer cut
   to the shrunk depth, a dense-layer layout kept: ``first_k_dense_replace`` 1);
2. its MoE blocks, router and experts are where the contract puts them (a router that takes attributes of
   its block after the hidden states -- MiniMax-M2's selection bias -- is called with them:
   ``Adapter.router_args``); E is a config field equal to the experts module's first dimension, top-k is
   ``config.num_experts_per_tok``;
3. the router's weights are ``Scoring.weigh`` of its logits: softmax or sigmoid, renormalised or not (a
   ``norm_topk_prob`` field decides it when flipping it flips the fit), times a scale a config field holds
   (set to 2.5 in the probe so that it shows);
4. its top-k is the selection score's (:meth:`~specmd.engine.record.Scoring.selection`) with a random
   selection bias on every router that holds one (``e_score_correction_bias``) and, where the config has
   ``n_group`` / ``topk_group``, a group limit scored ``top2`` or ``max``.

The tests run every derived family through the hook (``tests/test_derived.py``: lossless, replay == live);
a family that derives but does not pass them is refused by name in :data:`NOT_YET`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

# a tiny instance: the real model's layout at toy sizes (set only where the config has the field)
SHRINK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=260, kv_lora_rank=32, q_lora_rank=48,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, shared_expert_intermediate_size=64,
              max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
              pad_token_id=258, first_k_dense_replace=1,
              # linear-attention and delta-net layers of the hybrids (Kimi-Linear, Qwen3-Next, Qwen3.5)
              linear_num_heads=4, linear_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16,
              # Jamba's periodic layout at 4 layers: attention and experts on layers 1 and 3
              attn_layer_period=2, attn_layer_offset=1)
LAYERS = 4
EXPERTS, TOP_K = 16, 4
E_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # where configs keep E
SCALE_FIELDS = ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor",
                "moe_router_scaling_factor")
PROBE_SCALE = 2.5
GROUP_SCORES = ("top2", "max")

# families whose derived record the hook tests do not pass yet: family -> what is missing
NOT_YET: dict[str, str] = {}


@dataclass(frozen=True)
class Derived:
    """A family as derived: its ``adapter``, or None and the ``reason`` it cannot run."""

    family: str
    adapter: Optional[object] = None
    reason: Optional[str] = None
    bias: bool = False  # its routers hold a selection bias (adapter.bias_attr)


@functools.lru_cache(maxsize=None)
def moe_families() -> tuple[str, ...]:
    """Every model_type of the installed transformers with a causal-LM class whose config names experts
    (a field of :data:`E_FIELDS` or ``num_experts_per_tok``), sorted: what :func:`derive` is asked about."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            fields = AutoConfig.for_model(model_type).to_dict()
        except Exception:  # noqa: BLE001 -- a config class that does not build with its defaults
            continue
        if any(f in fields for f in E_FIELDS + ("num_experts_per_tok",)):
            out.append(model_type)
    return tuple(out)


def tiny_overrides(model_type: str) -> dict:
    """The config overrides of ``model_type``'s tiny random instance (the derived record's ``tiny``)."""
    from transformers import AutoConfig

    fields = AutoConfig.for_model(model_type).to_dict()
    over = {k: v for k, v in SHRINK.items() if k in fields}
    if "kv_lora_rank" in fields:  # multi-head latent attention: a key/value head per query head
        over.update(num_key_value_heads=SHRINK["num_attention_heads"], head_dim=SHRINK["qk_rope_head_dim"])
        if "qk_head_dim" in fields:
            over["qk_head_dim"] = SHRINK["qk_rope_head_dim"] + SHRINK["qk_nope_head_dim"]
    for k, v in (("index_head_dim", 16), ("index_n_heads", 4), ("index_topk", 8)):  # a sparse-attention indexer
        if k in fields:
            over[k] = v
    depth = fields.get("num_hidden_layers")
    over["num_hidden_layers"] = LAYERS
    for k, v in fields.items():  # per-layer lists (layer_types, mlp_layer_types, ...) cut to the depth,
        if isinstance(v, list) and depth and len(v) == depth:  # every kind of layer kept (the last ones replaced)
            cut = list(v[:LAYERS])
            lost = [x for x in dict.fromkeys(map(repr, v)) if x not in map(repr, cut)]
            for j, x in enumerate(lost[:LAYERS - 1]):
                cut[LAYERS - 1 - j] = next(y for y in v if repr(y) == x)
            over[k] = cut
    for f in E_FIELDS:
        if isinstance(fields.get(f), int):
            over[f] = EXPERTS
    if isinstance(fields.get("num_experts_per_tok"), int):
        over["num_experts_per_tok"] = TOP_K
    group = next((f for f in ("n_group", "num_expert_group") if f in fields), None)
    if group is not None and "topk_group" in fields:  # probed group-limited whatever its default (often 1 or None:
        over.update({group: 4, "topk_group": 2})     # a checkpoint's config.json sets them), so the fit sees it
    for f in SCALE_FIELDS:
        if isinstance(fields.get(f), (int, float)):
            over[f] = PROBE_SCALE
    return over


@functools.lru_cache(maxsize=None)
def derive(family: str) -> Derived:
    """``family``'s :class:`Derived` record, probed once per process (a tiny instance on the CPU, ~0.1 s)."""
    try:
        return _derive(family)
    except _Refuse as exc:
        return Derived(family, reason=str(exc))


class _Refuse(Exception):
    pass


def _build(family: str, over: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise _Refuse("transformers has no causal-LM class for it")
    try:
        config = AutoConfig.for_model(family, **over)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > 5e7:
            raise _Refuse(f"its tiny instance still has {size / 1e6:.0f}M parameters (a layout the probe does not "
                          f"shrink)")
        with torch.random.fork_rng(devices=[]):  # (the caller's random state is left as it was)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except _Refuse:
        raise
    except Exception as exc:  # noqa: BLE001 -- transformers' own validation of the shrunk config
        raise _Refuse(f"its tiny config does not build ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None
    return model.eval()


def _structure(model):
    """(MoE layer ids, the layer attribute holding the block, router attribute, experts module)."""
    import torch

    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise _Refuse("its decoder layers are not at model.model.layers (a wrapped or nested decoder)")
    found = sorted({n for layer in layers for n, m in layer.named_children() if hasattr(m, "experts")},
                   key=lambda n: n != "mlp")  # the layer attribute holding its MoE block (mlp first)
    if not found:
        raise _Refuse("its MoE block is no module of a decoder layer")
    if len(found) > 1:
        raise _Refuse(f"its decoder layers hold experts in several places ({', '.join(found)})")
    block_attr = found[0]
    moe = [i for i, layer in enumerate(layers) if hasattr(getattr(layer, block_attr, None), "experts")]
    if not hasattr(model, "lm_head"):
        raise _Refuse("it has no lm_head")
    block = getattr(layers[moe[0]], block_attr)
    attr = next((a for a in ("gate", "router") if isinstance(getattr(block, a, None), torch.nn.Module)), None)
    if attr is None:
        raise _Refuse("its MoE block has no router module (.gate or .router)")
    experts = block.experts
    if not any(isinstance(getattr(experts, n, None), torch.nn.Parameter) for n in ("gate_up_proj", "up_proj")):
        raise _Refuse("its experts are not transformers' fused [E, ...] experts (gate_up_proj / up_proj)")
    return moe, block_attr, attr, experts


def _router_args(router, block) -> tuple:
    """The block attributes the router's forward takes after the hidden states (``Adapter.router_args``):
    each further parameter of its signature that the block holds as a tensor; () when it takes the hidden
    states alone. A parameter the block does not hold is refused."""
    import inspect

    import torch

    params = list(inspect.signature(router.forward).parameters.values())[1:]
    names = tuple(p.name for p in params if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    lacking = [n for n in names if not isinstance(getattr(block, n, None), torch.Tensor)]
    if lacking:
        raise _Refuse(f"its router needs more than the hidden states ({', '.join(lacking)}, which its MoE block does "
                      f"not hold)")
    return names


def _route(router, hidden):
    """``router(hidden)`` (a module's forward, or an ``Adapter.router_call``): (logits, weights, index)."""
    import torch

    try:
        with torch.no_grad():
            out = router(hidden)
    except Exception as exc:  # noqa: BLE001 -- a router that needs more than the hidden states
        raise _Refuse(f"its router needs more than the hidden states ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]})") from None
    if not isinstance(out, tuple) or len(out) != 3:
        n = len(out) if isinstance(out, tuple) else 1
        raise _Refuse(f"its router returns {n} value(s), not (logits, weights, index)")
    return out


def _fit(logits, weights, index):
    """(sigmoid, renorm, scale) whose ``Scoring.weigh`` gives the router's weights, or None."""
    import torch

    from ..engine.record import Scoring

    for sigmoid in (False, True):
        for renorm in (True, False):
            s = Scoring(sigmoid, renorm, 1.0)
            ratio = weights.float() / s.weigh(s.probs(logits), index).clamp_min(1e-30)
            c = float(ratio.mean())
            if math.isfinite(c) and torch.allclose(ratio, torch.full_like(ratio, c), rtol=1e-4, atol=1e-6):
                return sigmoid, renorm, c
    return None


def _derive(family: str) -> Derived:
    import torch

    from .family import Adapter, ExpertsLayout

    over = tiny_overrides(family)
    model = _build(family, over)
    moe, block_attr, router_attr, experts = _structure(model)
    try:
        with torch.no_grad():  # a prefill and a decode step through its cache (what a run does)
            ids = torch.arange(8).reshape(1, 8) + 1
            out = model(ids, use_cache=True)
            model(ids[:, -1:] + 1, past_key_values=out.past_key_values, use_cache=True)
    except Exception as exc:  # noqa: BLE001 -- the shrunk layout does not run
        raise _Refuse(f"its tiny instance does not run ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None
    config = model.config
    E = next((int(p.shape[0]) for n in ("gate_up_proj", "up_proj") if (p := getattr(experts, n, None)) is not None))
    experts_attr = next((f for f in E_FIELDS if getattr(config, f, None) == E), None)
    if experts_attr is None:
        raise _Refuse(f"no config field of {', '.join(E_FIELDS)} holds its {E} experts")
    if not isinstance(getattr(config, "num_experts_per_tok", None), int):
        raise _Refuse("its config has no num_experts_per_tok (top-k)")
    hidden = torch.randn(48, int(config.hidden_size), generator=torch.Generator().manual_seed(0))
    block = getattr(model.model.layers[moe[0]], block_attr)
    router = getattr(block, router_attr)
    probe = Adapter(family, block_attr=block_attr, router_attr=router_attr, router_args=_router_args(router, block))
    logits, weights, index = _route(probe.router_call(model, moe[0]), hidden)
    fit = _fit(logits, weights, index)
    if fit is None:
        raise _Refuse("its router's weights are no softmax or sigmoid of its logits, renormalised or scaled")
    sigmoid, renorm, c = fit
    scale_attr = None
    if abs(c - 1.0) > 1e-4:
        scale_attr = next((f for f in SCALE_FIELDS if abs(float(getattr(config, f, math.nan)) - c) < 1e-4), None)
        if scale_attr is None:
            raise _Refuse(f"its router scales the weights by {c:.4g}, which no config field holds")
    if isinstance(getattr(config, "norm_topk_prob", None), bool):  # does the field decide the renormalisation?
        flipped = _build(family, dict(over, norm_topk_prob=not config.norm_topk_prob))
        fit2 = _fit(*_route(probe.router_call(flipped, moe[0]), hidden))
        if fit2 is not None and fit2[1] != renorm:
            renorm = "norm_topk_prob" if renorm == config.norm_topk_prob else None
            if renorm is None:
                raise _Refuse("its renormalisation is the opposite of its norm_topk_prob field")
    adapter = Adapter(family, block_attr=block_attr, router_attr=router_attr, router_args=probe.router_args,
                      score="sigmoid" if sigmoid else "softmax", renorm=renorm,
                      scale_attr=scale_attr, experts_attr=experts_attr, tiny=over, hub=None,
                      experts_layout=ExpertsLayout(gated=getattr(experts, "has_gate", True),
                                                   transposed=getattr(experts, "is_transposed", False),
                                                   bias=getattr(experts, "has_bias", False),
                                                   post_norm=getattr(experts, "has_post_expert_norm", False)))
    adapter = _selection(adapter, model, moe, hidden)
    if family in NOT_YET:
        raise _Refuse(NOT_YET[family])
    holder = adapter.bias_holder(model, moe[0])
    return Derived(family, adapter=adapter, bias=isinstance(getattr(holder, adapter.bias_attr, None), torch.Tensor))


def real_model(family: str) -> Optional[str]:
    """The hub checkpoint whose configuration transformers' config class of ``family`` instantiates by
    default (the first ``huggingface.co/<org>/<name>`` its docstring links), or None."""
    import re

    from transformers import AutoConfig

    try:
        doc = type(AutoConfig.for_model(family)).__doc__ or ""
    except Exception:  # noqa: BLE001 -- a config class that does not build with its defaults
        return None
    m = re.search(r"huggingface\.co/([\w.-]+/[\w.-]+)", doc)
    return m.group(1).rstrip(".") if m else None


def _selection(adapter, model, moe, hidden):
    """``adapter`` with the group rule whose selection reproduces every router's top-k under a random
    selection bias (on each router that holds one)."""
    import dataclasses

    import torch

    holders = [adapter.bias_holder(model, i) for i in moe]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for h in holders:
            bias = getattr(h, adapter.bias_attr, None)
            if isinstance(bias, torch.Tensor):  # scores mostly negative: a router that fills the groups it leaves
                bias.copy_(torch.rand(bias.shape, generator=g) * 0.5 - 1.0)  # out with 0.0, not -inf, disagrees
    routed = [_route(adapter.router_call(model, i), hidden) for i in moe]
    grouped = (getattr(model.config, "n_group", 1) or 1) > 1
    for group_score in (GROUP_SCORES + (None,) if grouped else (None,)):  # (a router may ignore the groups)
        candidate = dataclasses.replace(adapter, group_score=group_score)
        try:
            scoring = candidate.scoring(model.config, holders)
        except (ConfigError, ValueError) as exc:
            raise _Refuse(f"its group limit does not fit ({exc})") from None
        k = routed[0][2].shape[-1]
        if all(_same_sets(torch.topk(scoring.selection(scoring.probs(lg), l), k, dim=-1).indices, idx)
               for l, (lg, _, idx) in enumerate(routed)):
            return candidate
    raise _Refuse("its top-k is not the top-k of its probabilities plus a selection bias within a group limit "
                  "(left-out groups masked with -inf)")


def _same_sets(a, b) -> bool:
    return bool((a.sort(-1).values == b.sort(-1).values).all())
