"""The tiny random instance a family is probed on (:mod:`specmd.models.derive`, step 1): the config overrides
that shrink its config class to toy sizes with its layout kept (:func:`tiny_overrides`: :data:`SHRINK`, a
wrapper's towers :data:`SHRINK_TOWER`, one layer of every kind, what a class leaves None :data:`TINY_FIXES`,
E, top-k and a weights' scale set where the config holds them), the instance built from them (:func:`build`)
and run (:func:`runs`), and :class:`Refuse`: how every step of the probe refuses a family, with the reason."""

from __future__ import annotations

from typing import Optional

from .family import build_config

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

SCALE_FIELDS = ("routed_scaling_factor", "route_scale", "router_scaling_factor", "moe_routed_scaling_factor",
                "moe_router_scaling_factor")
PROBE_SCALE = 2.5


def tiny_overrides(model_type: str) -> dict:
    """The config overrides of ``model_type``'s tiny random instance (the derived record's ``tiny``); a wrapper's
    (a ``text_config``) nest its text decoder's and shrink its other towers (:data:`SHRINK_TOWER`)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    field = text_field(config)
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


def text_field(config) -> Optional[str]:
    """The field of a wrapper's ``config`` holding its text decoder's config (``text_config``), or None when
    ``config`` is the text decoder's own. Errors: Refuse where it is nested deeper (Qwen3-Omni's
    ``thinker_config.text_config``)."""
    text = config.get_text_config(decoder=True)
    if text is config:
        return None
    field = next((k for k, v in vars(config).items() if v is text), None)
    if field is None:
        raise Refuse(f"its text decoder's config is nested below {type(config).__name__}'s sub-configs")
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


class Refuse(Exception):
    pass


def build(family: str, over: dict):
    import torch

    from .contract import adopt, random_fill
    from .family import Adapter

    auto = Adapter(family).auto_class()
    try:
        config = build_config(family, over)
        with torch.device("meta"):
            size = sum(p.numel() for p in auto.from_config(config).parameters())
        if size > 5e7:
            raise Refuse(f"its tiny instance still has {size / 1e6:.0f}M parameters (a layout the probe does not "
                          f"shrink)")
        with torch.random.fork_rng(devices=[]):  # (the caller's random state is left as it was)
            torch.manual_seed(0)
            model = auto.from_config(config, dtype=torch.float32)
        adopt(model)  # a block outside the contract, put into it (Llama-4's: specmd.models.contract)
        random_fill(model)  # (DeepSeek-V4's hash table: transformers leaves it zeros)
    except Refuse:
        raise
    except Exception as exc:  # noqa: BLE001 -- transformers' own validation of the shrunk config
        raise Refuse(f"its tiny config does not build ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None
    return model.eval()


def runs(model) -> None:
    """A prefill and a decode step through its cache, and greedy generation (what a run does), or refused."""
    import torch

    try:
        with torch.no_grad():
            ids = torch.arange(8).reshape(1, 8) + 1
            out = model(ids, use_cache=True)
            model(ids[:, -1:] + 1, past_key_values=out.past_key_values, use_cache=True)
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except Exception as exc:  # noqa: BLE001 -- the shrunk layout does not run
        raise Refuse(f"its tiny instance does not run ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None
