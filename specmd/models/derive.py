"""Families derived from transformers' own classes: a model family the installed transformers ships, that no
record in :data:`~specmd.models.adapters.ADAPTERS` describes, is read off a tiny random instance of its own
config class -- where its MoE blocks are, which module routes, how the router's weights follow from its
logits, what selection rule picks its top-k, what its fused experts compute -- and runs with the
:class:`~specmd.models.family.Adapter` so derived, or is refused with the reason.

A family that follows transformers 5's MoE contract needs no record at all: a decoder whose ``layers`` hold
the blocks (``model.model``; a vision-language wrapper's ``model.language_model``: ``Adapter.decoder_path``),
the block one attribute of a layer (``mlp``; ``block_sparse_moe``, ``feed_forward``, ``mixer`` elsewhere, or
the layer itself: ``Adapter.block_attr``) with a router (``gate`` or ``router``) whose ``forward(hidden)``
returns ``(logits [T, E], weights [T, k], index [T, k])`` and fused experts (``experts(hidden, index,
weights)``, ``[E, ...]`` parameters, the flags ``use_experts_implementation`` sets), and an ``lm_head``
(``Adapter.head_path``). What the probe reads, in order (each step's failure is the reason a family is
refused, one line naming what it lacks):

1. the family has a causal-LM class (a wrapper whose causal LM is its text model runs as that:
   :func:`text_family`) or an image-text-to-text one, and its config class builds shrunk
   (:mod:`specmd.models.tiny`: :data:`~specmd.models.tiny.SHRINK`, towers :data:`~specmd.models.tiny.SHRINK_TOWER`;
   one layer of every kind kept, :func:`~specmd.models.tiny._layers`; what a class leaves None,
   :data:`~specmd.models.tiny.TINY_FIXES`), runs and generates;
2. its decoder, blocks, router and experts are found (a router that takes attributes of its block after the
   hidden states -- MiniMax-M2's selection bias -- is called with them: ``Adapter.router_args``; one that
   reads ``[B, S, H]``: ``Adapter.router_batched``); E and top-k are config fields
   (:data:`~specmd.models.tiny.E_FIELDS`, :data:`~specmd.models.tiny.TOPK_FIELDS`);
3. (steps 3 to 5: :mod:`specmd.models.probe`) with every router's projection spread at random, its weights are
   ``Scoring.weigh`` of its first output: softmax or sigmoid of the logits, or the probabilities it returns
   (:data:`~specmd.models.probe.SCORES`), renormalised or not (a ``norm_topk_prob`` field decides it when
   flipping it flips the fit), times a scale a config field holds (set to 2.5 in the probe so that it shows) or
   a learned per-expert scale;
4. its experts compute what specmd's kernel does, bit for bit (summed in rank order, or in their own loop's:
   ``ExpertsLayout.own_loop``);
5. its top-k is the selection score's (:meth:`~specmd.engine.record.Scoring.scores_of`) with a random
   selection bias on every router that holds one (``e_score_correction_bias``, wherever in the router:
   ``Adapter.bias_path``; added to the probabilities or the logits) and, where the config has ``n_group`` /
   ``topk_group``, a group limit scored ``top2`` or ``max``, left-out groups scored -inf or 0.0.

The tests run every derived family through the hook (``tests/models/test_derived.py``: lossless, replay == live);
a family that derives but does not pass them is refused by name in :data:`NOT_YET`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from .family import causal_lm_classes, image_text_classes
from .probe import (PROBE_TOKENS, bias_place, call, identity_attr, kernel_agrees, route, router_args, selection,
                    spread_routers, weights_rule)
from .tiny import E_FIELDS, TOPK_FIELDS, Refuse, build, runs, tiny_overrides

# families whose derived record the hook tests do not pass yet: family -> what is missing
NOT_YET: dict[str, str] = {}


@dataclass(frozen=True)
class Derived:
    """A family as derived: its ``adapter``, or None and the ``reason`` it cannot run."""

    family: str
    adapter: Optional[object] = None
    reason: Optional[str] = None
    bias: bool = False  # its routers hold a selection bias (adapter.bias_attr)
    runs_as: Optional[str] = None  # the text family a wrapper's checkpoint runs as (:func:`text_family`)
    hashed: bool = False  # some of its MoE layers are hash-routed (Adapter.hashed: DeepSeek-V4's first layers)


@functools.lru_cache(maxsize=None)
def moe_families() -> tuple[str, ...]:
    """Every model_type of the installed transformers with a causal-LM or an image-text-to-text class whose
    (text decoder's) config names experts (a field of :data:`E_FIELDS` or :data:`TOPK_FIELDS`), sorted:
    what :func:`derive` is asked about. Vision-language and omni wrappers count (Qwen3.5-MoE's hub checkpoints
    are ``qwen3_5_moe``, Kimi-K2.5's ``kimi_k25``): a checkpoint names the wrapper."""
    from transformers import AutoConfig

    out = []
    for model_type in sorted(set(causal_lm_classes()) | set(image_text_classes())):
        try:
            config = AutoConfig.for_model(model_type)
            fields = config.get_text_config(decoder=True).to_dict()
        except Exception:  # noqa: BLE001 -- a config class that does not build with its defaults
            continue
        if any(f in fields for f in E_FIELDS + TOPK_FIELDS):
            out.append(model_type)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def text_family(model_type: str) -> str:
    """The family a checkpoint of ``model_type`` runs as: the text model's ``model_type`` where transformers'
    causal-LM class for it is the text model alone (``AutoModelForCausalLM`` on a Qwen3.5-MoE or Llama-4
    checkpoint builds ``Qwen3_5MoeForCausalLM`` / ``Llama4ForCausalLM``, configs ``qwen3_5_moe_text`` /
    ``llama4_text``, and loads the text weights), else ``model_type`` itself. Read off the class transformers
    maps it to (its ``config_class``), not listed."""
    import transformers

    name = causal_lm_classes().get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    text = getattr(getattr(cls, "config_class", None), "model_type", None)
    return text if isinstance(text, str) and text and text != model_type and text in causal_lm_classes() else model_type


@functools.lru_cache(maxsize=None)
def derive(family: str) -> Derived:
    """``family``'s :class:`Derived` record, probed once per process (a tiny instance on the CPU, ~0.1 s)."""
    try:
        return _derive(family)
    except Refuse as exc:
        return Derived(family, reason=str(exc))


def _structure(model) -> dict:
    """Where the family keeps its parts: ``decoder_path``, ``head_path``, ``block_attr``, ``router_attr`` (the
    :class:`~specmd.models.family.Adapter` fields), with the MoE layer ids (``moe``) and the first block's
    ``experts`` module."""
    import torch

    from .family import Adapter

    decoders = [name for name, m in model.named_modules()  # the module whose layers hold the experts
                if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)
                and any(hasattr(c, "experts") for layer in m.layers for n, c in layer.named_modules() if n.count(".") <= 1)]
    if not decoders:
        raise Refuse("its MoE block is no module of a decoder layer")
    if len(decoders) > 1:
        raise Refuse(f"its MoE layers are in several decoders ({', '.join(decoders)})")
    decoder_path = decoders[0]
    layers = model.get_submodule(decoder_path).layers
    found = sorted({n for layer in layers for n, m in layer.named_modules()  # the layer attribute holding its MoE
                    if n and n.count(".") <= 1 and hasattr(m, "experts")}, key=lambda n: n != "mlp")  # block (mlp
    if not found:  # first); the layer is the block (Gemma-4: router and experts beside the dense MLP)
        found = [""]
    if len(found) > 1:  # several expert sets (ERNIE-4.5-VL: text and vision experts): the one a text pass runs
        found = _run_on_text(model, layers, found)
    block_attr = found[0]
    block_of = Adapter("", block_attr=block_attr)._block_of
    moe = [i for i, layer in enumerate(layers) if hasattr(block_of(layer), "experts")]
    heads = [name for name, _ in model.named_modules() if name.split(".")[-1] == "lm_head"]
    if len(heads) != 1:
        raise Refuse("its model has no lm_head" if not heads else f"its model has several LM heads ({', '.join(heads)})")
    block = block_of(layers[moe[0]])
    attr = next((a for a in ("gate", "router") if isinstance(getattr(block, a, None), torch.nn.Module)), None)
    if attr is None:
        raise Refuse("its MoE block has no router module (.gate or .router)")
    experts = block.experts
    if not any(isinstance(getattr(experts, n, None), torch.nn.Parameter) for n in ("gate_up_proj", "up_proj")):
        raise Refuse("its experts are not transformers' fused [E, ...] experts (gate_up_proj / up_proj)")
    return dict(decoder_path=decoder_path, head_path=heads[0], block_attr=block_attr, router_attr=attr, moe=moe,
                experts=experts)


def _run_on_text(model, layers, found: list) -> list:
    """Of the layer paths ``found`` holding experts, the one whose experts a text forward pass calls (ERNIE-4.5-VL:
    ``mlp.text_moe``, not ``mlp.vision_moe``), or refused: several, or none."""
    import torch

    from .family import Adapter

    called = set()
    handles = [m.experts.register_forward_hook(lambda *_, n=n: called.add(n))
               for layer in layers for n in found if (m := Adapter("", block_attr=n)._block_of(layer)) is not None]
    try:
        with torch.no_grad():
            model(torch.arange(8).reshape(1, 8) + 1)
    finally:
        for h in handles:
            h.remove()
    if len(called) != 1:
        raise Refuse(f"its decoder layers hold experts in several places ({', '.join(found)}), "
                      f"{'each' if called else 'none'} run on text")
    return sorted(called)


def _derive(family: str) -> Derived:
    import torch

    from .family import Adapter, ExpertsLayout

    if family not in causal_lm_classes() and family not in image_text_classes():
        raise Refuse("transformers has no causal-LM or image-text-to-text class for it")
    runs_as = text_family(family)
    if runs_as != family:  # transformers' causal LM of a wrapper is its text model: the checkpoint runs as that
        d = derive(runs_as)
        return Derived(family, adapter=d.adapter, reason=d.reason, bias=d.bias, runs_as=runs_as, hashed=d.hashed)
    # 1. its tiny instance builds, runs and generates; where its parts are
    over = tiny_overrides(family)
    model = build(family, over)
    parts = _structure(model)
    moe, experts = parts.pop("moe"), parts.pop("experts")
    runs(model)
    # 2. E and top-k are config fields
    config = Adapter.text(model.config)
    E = int(experts.down_proj.shape[0])  # (an up projection may have rows for identity experts: LongCat-Flash's)
    experts_attr = next((f for f in E_FIELDS if getattr(config, f, None) == E), None)
    if experts_attr is None:
        raise Refuse(f"its {E} experts are in no config field of {', '.join(E_FIELDS)}")
    topk_attr = next((f for f in TOPK_FIELDS if isinstance(getattr(config, f, None), int)), None)
    if topk_attr is None:
        raise Refuse(f"its config has no top-k field ({', '.join(TOPK_FIELDS)})")
    # 3. how the router is called, and how its weights follow from its first output
    hidden = torch.randn(48, int(config.hidden_size), generator=torch.Generator().manual_seed(0))
    PROBE_TOKENS.ids = torch.randint(0, int(config.vocab_size), (48,), generator=torch.Generator().manual_seed(7))
    base = Adapter(family, **parts)
    block = base.block(model, moe[0])
    probe = dataclasses.replace(base, router_args=router_args(base.router(model, moe[0]), block))
    try:  # [T, H], or [1, T, H] where its router reads a sequence axis
        columns = route(call(probe, model, moe[0]), hidden)[0].shape[-1]
    except Refuse:
        probe = dataclasses.replace(probe, router_batched=True)
        columns = route(call(probe, model, moe[0]), hidden)[0].shape[-1]
    probe = dataclasses.replace(probe, identity_attr=identity_attr(config, E, columns))  # (columns past E)
    spread_routers(probe, model, moe, columns)
    rule = weights_rule(family, over, probe, model, moe, columns, hidden)
    adapter = dataclasses.replace(
        probe, **bias_place(probe, model, moe[0], E), **rule, experts_attr=experts_attr,
        topk_attr=topk_attr, tiny=over,
        experts_layout=ExpertsLayout(gated=getattr(experts, "has_gate", True),
                                     transposed=getattr(experts, "is_transposed", False),
                                     bias=getattr(experts, "has_bias", False),
                                     post_norm=getattr(experts, "has_post_expert_norm", False)))
    # 4. its experts compute what the kernel does; 5. its top-k is the selection score's
    up = experts.gate_up_proj if adapter.experts_layout.gated else experts.up_proj  # [E, 2I, H'] or [E, H', 2I]
    width = up.shape[1 if adapter.experts_layout.transposed else 2]  # the experts' own input width
    x = torch.randn(48, int(width), generator=torch.Generator().manual_seed(6))
    adapter = dataclasses.replace(adapter, experts_layout=kernel_agrees(experts, adapter.experts_layout, E, x, columns))
    adapter = selection(adapter, model, moe, hidden)
    if family in NOT_YET:
        raise Refuse(NOT_YET[family])
    holders = [adapter.bias_holder(model, i) for i in moe]  # (DeepSeek-V4's hash layers hold none)
    return Derived(family, adapter=adapter,
                   bias=any(isinstance(getattr(h, adapter.bias_attr, None), torch.Tensor) for h in holders),
                   hashed=bool(adapter.hashed(model)))


def real_model(family: str) -> Optional[str]:
    """The hub checkpoint whose configuration transformers' config class of ``family`` instantiates by
    default (the first ``huggingface.co/<org>/<name>`` its docstring links), or None."""
    import re

    from transformers import AutoConfig

    try:
        doc = type(AutoConfig.for_model(family)).__doc__ or ""
    except Exception:  # noqa: BLE001 -- a config class that does not build with its defaults
        return None
    m = re.search(r"huggingface\.co/(?!papers/|docs/|spaces/|datasets/)([\w.-]+/[\w.-]+)", doc)  # (a model, not a
    # paper page: AfMoE's docstring links one first)
    return m.group(1).rstrip(".") if m else None
