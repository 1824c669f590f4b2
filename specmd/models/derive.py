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
   :func:`text_family`) or an image-text-to-text one, and its config class builds shrunk (:data:`SHRINK`,
   towers :data:`SHRINK_TOWER`; one layer of every kind kept, :func:`_layers`; what a class leaves None,
   :data:`TINY_FIXES`), runs and generates;
2. its decoder, blocks, router and experts are found (a router that takes attributes of its block after the
   hidden states -- MiniMax-M2's selection bias -- is called with them: ``Adapter.router_args``; one that
   reads ``[B, S, H]``: ``Adapter.router_batched``); E and top-k are config fields (:data:`E_FIELDS`,
   :data:`TOPK_FIELDS`);
3. with every router's projection spread at random, its weights are ``Scoring.weigh`` of its first output:
   softmax or sigmoid of the logits, or the probabilities it returns (:data:`SCORES`), renormalised or not (a
   ``norm_topk_prob`` field decides it when flipping it flips the fit), times a scale a config field holds
   (set to 2.5 in the probe so that it shows) or a learned per-expert scale;
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
import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from .family import TOKEN_IDS, TokenIds, build_config, causal_lm_classes, image_text_classes

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
              attn_layer_period=2, attn_layer_offset=1,
              # Mamba-2 layers (Granite-4.0-H, Nemotron-H; heads x head dim = 2 x hidden), Jamba's Mamba
              mamba_n_heads=8, mamba_d_head=16, mamba_num_heads=8, mamba_head_dim=16, mamba_d_state=16,
              ssm_state_size=16, mamba_chunk_size=16, chunk_size=16, n_groups=1, mamba_dt_rank=8,
              # Gemma-4's per-layer input embeddings, LongCat-Flash's expert width
              vocab_size_per_layer_input=260, hidden_size_per_layer_input=16, expert_ffn_hidden_size=32,
              moe_hidden_size=32,  # (MuSe-Spark's experts work in a projected width)
              zero_expert_num=8)  # LongCat-Flash's identity experts: 256 beside 512 at 16 (its ratio)
# a wrapper's vision / audio towers (set only where the tower's config has the field; its output width the text's)
SHRINK_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=1, num_attention_heads=2,
                    num_heads=2, num_key_value_heads=2, head_dim=16, encoder_layers=1, d_model=32,
                    encoder_attention_heads=2, encoder_ffn_dim=64, num_layers=1)
TOWER_OUT = ("out_hidden_size", "text_hidden_size", "projection_dim", "output_dim")
LAYERS = 4
SHRINK_WINDOW = 64  # a sliding window its config class leaves None
MAX_LAYERS = 8  # a tiny instance keeps one layer of each kind, up to this many
# where configs keep top-k (Aria: moe_topk, ERNIE-VL: moe_k, Gemma-4: top_k_experts)
TOPK_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts")
# what a family's config class leaves None and its model needs (a checkpoint's config.json sets it), declared as
# data: the layout of its real model at toy sizes
TINY_FIXES = {
    "gemma4_text": dict(enable_moe_block=True),  # Gemma-4's MoE variant (26B-A4B): its dense default has none
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),  # LFM2-8B-A1B's mix
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2),  # Granite-4.0-H: Mamba-2 and
    # attention layers (its class default is Mamba-2 alone, no KV cache to run)
    "dots1": dict(n_shared_experts=2),  # dots.llm1: 2 shared experts (its class default None builds none)
    "zaya": dict(num_experts_per_tok=1),  # ZAYA1 routes top-1 (its validator refuses any other)
    "glm4v_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                mrope_section=[2, 1, 1])),  # GLM-4.5V's [8, 12, 12] at the toy head
    # Qwen3-Omni's thinker reads its vision / audio start tokens in generation (its config.json sets them; its
    # class leaves them out): ids no text of the tiny vocabulary holds
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=259, audio_start_token_id=259, position_id_per_seconds=13),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),  # DeepSeek-OCR-2's
    # ERNIE-4.5-VL's 3-D rope pre-rotates its height / width / time sections ([22, 22, 20] of 64 frequencies) at
    # the toy head (8 frequencies); its class default leaves the sections to the model code's real-size default
    "ernie4_5_vl_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                      mrope_section=[2, 2, 4])),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),
}
EXPERTS, TOP_K = 16, 4
E_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # where configs keep E
IDENTITY_FIELDS = ("zero_expert_num",)  # where configs keep the identity experts' count (router columns past E)
SCALE_FIELDS = ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor",
                "moe_router_scaling_factor")
PROBE_SCALE = 2.5
GROUP_SCORES = ("top2", "max")
GROUP_FILLS = (float("-inf"), 0.0)  # what a left-out group scores (transformers' DeepSeek-V3; A.X-K2)
SCORES = ("softmax", "sigmoid", "sqrtsoftplus", "probabilities")  # Adapter.score: what the router's first output is taken through

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


def tiny_overrides(model_type: str) -> dict:
    """The config overrides of ``model_type``'s tiny random instance (the derived record's ``tiny``); a wrapper's
    (a ``text_config``) nest its text decoder's and shrink its other towers (:data:`SHRINK_TOWER`)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    field = _text_field(config)
    if field is None:
        return _text_overrides(config.to_dict())
    over = {field: _text_overrides(getattr(config, field).to_dict())}
    width = over[field].get("hidden_size", SHRINK["hidden_size"])
    top = config.to_dict()
    for name, sub in top.items():  # the vision / audio towers at toy sizes, projected to the text width
        if name.endswith("_config") and name != field and isinstance(sub, dict):
            tower = _tower_overrides(sub, width)
            if tower:
                over[name] = tower
    over.update(TINY_FIXES.get(model_type, {}))
    over.update({k: width for k in TOWER_OUT if isinstance(top.get(k), int)})  # the projector between them, at the
    if isinstance(top.get("projector_hidden_size"), int):  # wrapper's level (MuSe-Spark's)
        over["projector_hidden_size"] = SHRINK_TOWER["intermediate_size"]
    return over


def _text_field(config) -> Optional[str]:
    """The field of a wrapper's ``config`` holding its text decoder's config (``text_config``), or None when
    ``config`` is the text decoder's own. Errors: _Refuse where it is nested deeper (Qwen3-Omni's
    ``thinker_config.text_config``)."""
    text = config.get_text_config(decoder=True)
    if text is config:
        return None
    field = next((k for k, v in vars(config).items() if v is text), None)
    if field is None:
        raise _Refuse(f"its text decoder's config is nested below {type(config).__name__}'s sub-configs")
    return field


def _text_overrides(fields: dict) -> dict:
    over = {k: v for k, v in SHRINK.items()  # (a size of 0 is a layout: GLM-5-Next's NoPE attention)
            if k in fields and (fields[k] != 0 or k.endswith("_token_id"))}
    for k, v in list(over.items()):  # a size per expert set (ERNIE-4.5-VL: text and vision experts)
        if isinstance(fields[k], list) and not isinstance(v, list):
            over[k] = [v] * len(fields[k])
    if "sliding_window" in fields and fields["sliding_window"] is None:  # (Step-3.5 reads it whatever its layers)
        over["sliding_window"] = SHRINK_WINDOW
    if "kv_lora_rank" in fields:  # multi-head latent attention: a key/value head per query head, head_dim as the
        over.update(num_key_value_heads=SHRINK["num_attention_heads"], head_dim=_mla_head_dim(fields))  # default's
        if "qk_head_dim" in fields:
            over["qk_head_dim"] = SHRINK["qk_rope_head_dim"] + SHRINK["qk_nope_head_dim"]
    for k, v in (("index_head_dim", 16), ("index_n_heads", 4), ("index_topk", 8)):  # a sparse-attention indexer
        if k in fields:
            over[k] = v
    if isinstance(fields.get("index_kpool"), int):  # (GLM-5-Next: its top-k pools whole blocks)
        over["index_topk"] = fields["index_kpool"]
    over.update(_layers(fields))
    for names, value in ((E_FIELDS, EXPERTS), (TOPK_FIELDS, TOP_K)):  # every one the config sets, else the first
        ints = [f for f in names if isinstance(fields.get(f), int)]  # it has (dots1 defaults its E to None,
        over.update(dict.fromkeys(ints or [f for f in names if f in fields][:1], value))  # Gemma-4 its top-k)
    group = next((f for f in ("n_group", "num_expert_group") if f in fields), None)
    if group is not None and "topk_group" in fields:  # probed group-limited whatever its default (often 1 or None:
        over.update({group: 4, "topk_group": 2})     # a checkpoint's config.json sets them), so the fit sees it
    for f in SCALE_FIELDS:
        if isinstance(fields.get(f), (int, float)):
            over[f] = PROBE_SCALE
    for entry in over.get("per_layer_config", {}).values():  # a layer's own sizes are the shrunk ones
        entry.update({k: over[k] for k in entry if k in over})
    over.update(TINY_FIXES.get(fields.get("model_type"), {}))
    return over


def _mla_head_dim(fields: dict) -> int:
    """A latent-attention model's tiny ``head_dim``, what its default is made of: the rope and no-rope parts
    (dots.llm3's sliding layers, Mistral-4), the rope part (DeepSeek-V3), or a multiple of it."""
    rope, nope = SHRINK["qk_rope_head_dim"], SHRINK["qk_nope_head_dim"]
    d_rope, d_nope, d_head = (fields.get(k) or 0 for k in ("qk_rope_head_dim", "qk_nope_head_dim", "head_dim"))
    per_layer = fields.get("per_layer_config") if isinstance(fields.get("per_layer_config"), dict) else {}
    nopes = {d_nope} | {v.get("qk_nope_head_dim") for v in per_layer.values() if isinstance(v, dict)}
    if d_head and any(d_head == d_rope + (n or 0) for n in nopes):
        return rope + nope
    return rope * max(1, d_head // d_rope) if d_head and d_rope else rope


def _layers(fields: dict, keep: int = LAYERS) -> dict:
    """The depth and per-layer fields of a tiny instance: one layer of every kind the real model has (a kind: a
    layer's entries in every per-layer list -- ``layer_types``, ``mlp_layer_types``, ... -- and in
    ``per_layer_config``), at its first occurrence, with the first layers up to ``keep`` (a dense first layer
    stays first): at most :data:`MAX_LAYERS`. A list of layer indices (``kv_source_layers``: each layer its own)
    is renumbered."""
    name = next((k for k in ("num_hidden_layers", "num_layers") if isinstance(fields.get(k), int)), None)
    depth = fields.get(name)
    if name is None or depth <= 0:
        return {"num_hidden_layers": keep}
    lists = {k: v for k, v in fields.items() if isinstance(v, list) and len(v) == depth}
    per = fields.get("per_layer_config") if isinstance(fields.get("per_layer_config"), dict) else {}
    per_layer = {int(k): repr(v) for k, v in per.items() if str(k).isdigit()}
    kinds = {}
    for i in range(depth):
        kinds.setdefault(tuple(repr(v[i]) for v in lists.values() if v != list(range(depth))) + (per_layer.get(i),), i)
    src = sorted(kinds.values())[:MAX_LAYERS]
    fill = [i for i in range(depth) if i not in src][:max(0, min(keep, depth) - len(src))]
    src = sorted(src + fill)
    out = {name: len(src)}
    for k, v in lists.items():
        out[k] = list(range(len(src))) if v == list(range(depth)) else [v[i] for i in src]
    if per:
        width = max(len(str(k)) for k in per)
        out["per_layer_config"] = {str(j).zfill(width): dict(per[next(k for k in per if int(k) == i)])
                                   for j, i in enumerate(src) if i in per_layer}
    return out


def _tower_overrides(sub: dict, width: int) -> dict:
    """A vision / audio tower's config at toy sizes (:data:`SHRINK_TOWER`; its output width ``width``, the text
    decoder's), its per-layer lists cut to its one layer, its own sub-towers (SAM's, an encoder's) likewise."""
    tower = {k: v for k, v in SHRINK_TOWER.items() if k in sub}
    tower.update({k: width for k in TOWER_OUT if k in sub})
    depth = next((sub[k] for k in ("num_hidden_layers", "depth", "num_layers", "encoder_layers")
                  if isinstance(sub.get(k), int)), None)
    if depth:
        tower.update({k: v[:1] for k, v in sub.items() if isinstance(v, list) and len(v) == depth and depth > 1})
    for name, inner in sub.items():
        if name.endswith("_config") and isinstance(inner, dict):
            tower[name] = _tower_overrides(inner, width)
    return tower


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

    from .contract import adopt, random_fill
    from .family import Adapter

    auto = Adapter(family).auto_class()
    try:
        config = build_config(family, over)
        with torch.device("meta"):
            size = sum(p.numel() for p in auto.from_config(config).parameters())
        if size > 5e7:
            raise _Refuse(f"its tiny instance still has {size / 1e6:.0f}M parameters (a layout the probe does not "
                          f"shrink)")
        with torch.random.fork_rng(devices=[]):  # (the caller's random state is left as it was)
            torch.manual_seed(0)
            model = auto.from_config(config, dtype=torch.float32)
        adopt(model)  # a block outside the contract, put into it (Llama-4's: specmd.models.contract)
        random_fill(model)  # (DeepSeek-V4's hash table: transformers leaves it zeros)
    except _Refuse:
        raise
    except Exception as exc:  # noqa: BLE001 -- transformers' own validation of the shrunk config
        raise _Refuse(f"its tiny config does not build ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None
    return model.eval()


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
        raise _Refuse("its MoE block is no module of a decoder layer")
    if len(decoders) > 1:
        raise _Refuse(f"its MoE layers are in several decoders ({', '.join(decoders)})")
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
        raise _Refuse("its model has no lm_head" if not heads else f"its model has several LM heads ({', '.join(heads)})")
    block = block_of(layers[moe[0]])
    attr = next((a for a in ("gate", "router") if isinstance(getattr(block, a, None), torch.nn.Module)), None)
    if attr is None:
        raise _Refuse("its MoE block has no router module (.gate or .router)")
    experts = block.experts
    if not any(isinstance(getattr(experts, n, None), torch.nn.Parameter) for n in ("gate_up_proj", "up_proj")):
        raise _Refuse("its experts are not transformers' fused [E, ...] experts (gate_up_proj / up_proj)")
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
        raise _Refuse(f"its decoder layers hold experts in several places ({', '.join(found)}), "
                      f"{'each' if called else 'none'} run on text")
    return sorted(called)


def _router_args(router, block) -> tuple:
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
        raise _Refuse(f"its router needs more than the hidden states ({', '.join(lacking)}, which its MoE block does "
                      f"not hold)")
    return names


_PROBE_TOKENS = TokenIds()  # the probe's token ids (a hash-routed router reads them): one per hidden row


def _call(adapter, model, layer_id: int):
    """The layer's router as its block calls it, given the probe's token ids."""
    return adapter.router_call(model, layer_id, _PROBE_TOKENS)


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


def _derive(family: str) -> Derived:
    import torch

    from .family import Adapter, ExpertsLayout

    if family not in causal_lm_classes() and family not in image_text_classes():
        raise _Refuse("transformers has no causal-LM or image-text-to-text class for it")
    runs_as = text_family(family)
    if runs_as != family:  # transformers' causal LM of a wrapper is its text model: the checkpoint runs as that
        d = derive(runs_as)
        return Derived(family, adapter=d.adapter, reason=d.reason, bias=d.bias, runs_as=runs_as, hashed=d.hashed)
    # 1. its tiny instance builds, runs and generates; where its parts are
    over = tiny_overrides(family)
    model = _build(family, over)
    parts = _structure(model)
    moe, experts = parts.pop("moe"), parts.pop("experts")
    _runs(model)
    # 2. E and top-k are config fields
    config = Adapter.text(model.config)
    E = int(experts.down_proj.shape[0])  # (an up projection may have rows for identity experts: LongCat-Flash's)
    experts_attr = next((f for f in E_FIELDS if getattr(config, f, None) == E), None)
    if experts_attr is None:
        raise _Refuse(f"its {E} experts are in no config field of {', '.join(E_FIELDS)}")
    topk_attr = next((f for f in TOPK_FIELDS if isinstance(getattr(config, f, None), int)), None)
    if topk_attr is None:
        raise _Refuse(f"its config has no top-k field ({', '.join(TOPK_FIELDS)})")
    # 3. how the router is called, and how its weights follow from its first output
    hidden = torch.randn(48, int(config.hidden_size), generator=torch.Generator().manual_seed(0))
    _PROBE_TOKENS.ids = torch.randint(0, int(config.vocab_size), (48,), generator=torch.Generator().manual_seed(7))
    base = Adapter(family, **parts)
    block = base.block(model, moe[0])
    probe = dataclasses.replace(base, router_args=_router_args(base.router(model, moe[0]), block))
    try:  # [T, H], or [1, T, H] where its router reads a sequence axis
        columns = _route(_call(probe, model, moe[0]), hidden)[0].shape[-1]
    except _Refuse:
        probe = dataclasses.replace(probe, router_batched=True)
        columns = _route(_call(probe, model, moe[0]), hidden)[0].shape[-1]
    probe = dataclasses.replace(probe, identity_attr=_identity_attr(config, E, columns))  # (columns past E)
    _spread_routers(probe, model, moe, columns)
    rule = _weights_rule(family, over, probe, model, moe, columns, hidden)
    adapter = dataclasses.replace(
        probe, **_bias_place(probe, model, moe[0], E), **rule, experts_attr=experts_attr,
        topk_attr=topk_attr, tiny=over,
        experts_layout=ExpertsLayout(gated=getattr(experts, "has_gate", True),
                                     transposed=getattr(experts, "is_transposed", False),
                                     bias=getattr(experts, "has_bias", False),
                                     post_norm=getattr(experts, "has_post_expert_norm", False)))
    # 4. its experts compute what the kernel does; 5. its top-k is the selection score's
    up = experts.gate_up_proj if adapter.experts_layout.gated else experts.up_proj  # [E, 2I, H'] or [E, H', 2I]
    width = up.shape[1 if adapter.experts_layout.transposed else 2]  # the experts' own input width
    x = torch.randn(48, int(width), generator=torch.Generator().manual_seed(6))
    adapter = dataclasses.replace(adapter, experts_layout=_kernel_agrees(experts, adapter.experts_layout, E, x, columns))
    adapter = _selection(adapter, model, moe, hidden)
    if family in NOT_YET:
        raise _Refuse(NOT_YET[family])
    holders = [adapter.bias_holder(model, i) for i in moe]  # (DeepSeek-V4's hash layers hold none)
    return Derived(family, adapter=adapter,
                   bias=any(isinstance(getattr(h, adapter.bias_attr, None), torch.Tensor) for h in holders),
                   hashed=bool(adapter.hashed(model)))


def _bias_place(probe, model, layer: int, E: int) -> dict:
    """``bias_attr`` and ``bias_path``: where the layer's selection bias is -- an ``[E]`` tensor the block passes
    its router (LFM2-MoE's ``expert_bias``), else ``probe.bias_attr`` in the router or in a submodule of it
    (ERNIE-4.5's ``moe_statics``)."""
    block = probe.block(model, layer)
    bias_attr = next((n for n in probe.router_args if "bias" in n and getattr(block, n).shape == (E,)), probe.bias_attr)
    router = probe.router(model, layer)
    nested = [n.rsplit(".", 1)[0] for n, _ in (*router.named_buffers(), *router.named_parameters())
              if n.endswith("." + bias_attr)]
    return dict(bias_attr=bias_attr, bias_path=nested[0] if nested else "")


def _identity_attr(config, E: int, width: int) -> Optional[str]:
    """The config field holding the count of identity experts, router columns past the E experts with weights
    (:data:`IDENTITY_FIELDS`: LongCat-Flash's ``zero_expert_num``), or None where the router has E columns.
    Refused: more columns than any field explains."""
    if width == E:
        return None
    attr = next((f for f in IDENTITY_FIELDS if getattr(config, f, None) == width - E), None)
    if attr is None:
        raise _Refuse(f"its router scores {width} columns for {E} experts, and no config field of "
                      f"{', '.join(IDENTITY_FIELDS)} holds the {width - E} others")
    return attr


def _spread_routers(adapter, model, moe: list, E: int) -> None:
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


def _runs(model) -> None:
    """A prefill and a decode step through its cache, and greedy generation (what a run does), or refused."""
    import torch

    try:
        with torch.no_grad():
            ids = torch.arange(8).reshape(1, 8) + 1
            out = model(ids, use_cache=True)
            model(ids[:, -1:] + 1, past_key_values=out.past_key_values, use_cache=True)
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except Exception as exc:  # noqa: BLE001 -- the shrunk layout does not run
        raise _Refuse(f"its tiny instance does not run ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None


def _weights_rule(family: str, over: dict, probe, model, moe: list, E: int, hidden) -> dict:
    """The Adapter fields of how the router's weights follow from its first output: ``score``, ``renorm``
    (a ``norm_topk_prob`` field where flipping it flips the fit), ``scale_attr`` (the config field of a
    constant factor, :data:`SCALE_FIELDS`), ``weight_scale_attr`` (a learned per-expert factor)."""
    from .family import Adapter

    config = Adapter.text(model.config)
    router = probe.router(model, moe[0])
    scales = [_weight_scales(probe.router(model, i), E, probe.bias_attr) for i in moe]  # (every layer's drawn)
    scales = scales[0]  # the names: the first layer's
    logits, weights, index = _route(_call(probe, model, moe[0]), hidden)
    weight_scale_attr, fit = None, _fit(logits, weights, index)
    for name in scales if fit is None else ():  # weights that carry a learned per-expert scale
        fit = _fit(logits, weights, index, getattr(router, name))
        if fit is not None:
            weight_scale_attr = name
            break
    if fit is None:
        raise _Refuse("its router's weights are no softmax or sigmoid of its logits (or its first output), "
                      "renormalised or scaled")
    score, renorm, c = fit
    scale_attr = None
    if abs(c - 1.0) > 1e-4:
        scale_attr = next((f for f in SCALE_FIELDS if abs(float(getattr(config, f, math.nan)) - c) < 1e-4), None)
        if scale_attr is None:
            raise _Refuse(f"its router scales the weights by {c:.4g}, which no config field holds")
    if isinstance(getattr(config, "norm_topk_prob", None), bool):  # does the field decide the renormalisation?
        flip = {"norm_topk_prob": not config.norm_topk_prob}
        field = _text_field(model.config)  # (a wrapper's: the flag is its text decoder's)
        flipped = _build(family, dict(over, **{field: dict(over[field], **flip)}) if field else dict(over, **flip))
        _spread_routers(probe, flipped, moe, E)
        fit2 = _fit(*_route(_call(probe, flipped, moe[0]), hidden),
                    getattr(probe.router(flipped, moe[0]), weight_scale_attr) if weight_scale_attr else None)
        if fit2 is not None and fit2[1] != renorm:
            renorm = "norm_topk_prob" if renorm == config.norm_topk_prob else None
            if renorm is None:
                raise _Refuse("its renormalisation is the opposite of its norm_topk_prob field")
    return dict(score=score, renorm=renorm, scale_attr=scale_attr, weight_scale_attr=weight_scale_attr)


def _kernel_agrees(experts, layout, E: int, hidden, width: Optional[int] = None):
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
        raise _Refuse(f"its experts are not called as experts(hidden [T, H], index, weights) ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]})") from None
    raise _Refuse("its experts module computes other than specmd's experts kernel, summed in rank order or in its own "
                  f"loop's (max difference {float((own - mine).abs().max()):.2g}): offloaded would not equal simulated")


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


def _selection(adapter, model, moe, hidden):
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
    routed = [_route(_call(adapter, model, i), hidden) for i in moe]
    grouped = (getattr(adapter.text(model.config), "n_group", 1) or 1) > 1
    groups = [(g, fill) for g in GROUP_SCORES for fill in GROUP_FILLS] + [(None, GROUP_FILLS[0])] if grouped else \
        [(None, GROUP_FILLS[0])]  # (a router may ignore the groups)
    for (group_score, fill), on_logits in ((rule, on) for on in (False, True) for rule in groups):
        candidate = dataclasses.replace(adapter, group_score=group_score, group_fill=fill, bias_on_logits=on_logits)
        try:
            scoring = candidate.scoring(model.config, holders, candidate.hashed(model))
        except (ConfigError, ValueError) as exc:
            raise _Refuse(f"its group limit does not fit ({exc})") from None
        k = routed[0][2].shape[-1]
        if all(_same_sets(scoring.select(lg, l, k, idx), idx) for l, (lg, _, idx) in enumerate(routed)):
            return candidate
    raise _Refuse("its top-k is not the top-k of its probabilities (or logits) plus a selection bias within a group "
                  "limit (left-out groups scored -inf or 0.0)")


def _same_sets(a, b) -> bool:
    return bool((a.sort(-1).values == b.sort(-1).values).all())
