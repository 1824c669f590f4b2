"""A model's KV cache per sequence, read off its transformers config (:class:`~specmd.engine.memory.KvLayout`).

Which decoder layer attends how is transformers' own ``config.layer_types`` (``layers_block_type`` for the
Mamba hybrids; neither: every layer full attention, or sliding when a Mistral-style ``sliding_window`` is set
and not switched off); what each kind holds is below, at the model's dtype, per decoder layer:

* ``full_attention`` (and ``attention``, ``indexed_attention``, the attention half of ``hybrid``): per token
  ``2 * num_key_value_heads * head_dim`` (GQA: keys and values); with MLA (``kv_lora_rank`` set: DeepSeek-V2/V3,
  Kimi, LongCat, GLM-5) the compressed latent ``kv_lora_rank + qk_rope_head_dim`` that serving engines cache
  (vLLM, SGLang; DeepSeek-V2 §2.1.2: "only ... c_t^KV and k_t^R need to be cached"; transformers' eager cache
  holds the decompressed keys and values instead, 57x more for V3 -- the device a user serves on holds the
  latent), plus the sparse-attention indexer's key (``index_head_dim``: DeepSeek-V3.2, GLM-5's DSA) at the
  model's dtype (vLLM holds it in fp8: this overstates it by 1/(1 + latent/index) at bf16, 10% for GLM-5);
* ``sliding_attention`` / ``chunked_attention``: the same per token, for at most ``sliding_window`` /
  ``attention_chunk_size`` tokens of a sequence (Llama-4's chunked layers attend within their chunk);
* ``linear_attention``: a state per sequence, whatever its length -- gated DeltaNet (Qwen3-Next, Qwen3.5: each
  value head's ``key_dim x value_dim`` matrix, plus the short convolution's ``kernel - 1`` columns of q, k and v),
  Kimi's KDA (the same with ``linear_num_heads`` of ``linear_head_dim``), MiniMax's lightning attention
  (``heads x head_dim x head_dim``), Mamba-2 (Granite-4, Nemotron-H, Falcon-H1: ``heads x head_dim x
  d_state`` plus the convolution over ``d_inner + 2 * groups * d_state`` channels) and Mamba-1 (Jamba:
  ``d_inner x d_state`` plus ``d_inner`` convolution channels);
* ``moe`` / ``mlp`` blocks (Nemotron-H's) hold nothing.

Any other layer type (DeepSeek-V4's compressed attention) is ``unknown``: a run with ``hardware.memory_gb`` on
such a model is refused naming it; every other run is unaffected.
"""

from __future__ import annotations

from ..engine.memory import KvLayout

ATTENTION = ("full_attention", "attention", "indexed_attention")
WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
EMPTY = ("moe", "mlp")


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _layer_types(config) -> list:
    types = _get(config, "layer_types", "layers_block_type")
    if types:
        return list(types)
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False
    return ["sliding_attention" if sliding else "full_attention"] * int(config.num_hidden_layers)


def attention_token_elems(config) -> int:
    """Elements one full-attention layer caches per token (GQA's keys and values, or MLA's latent)."""
    if getattr(config, "kv_lora_rank", None):
        latent = int(config.kv_lora_rank) + int(_get(config, "qk_rope_head_dim", default=0))
        return latent + int(_get(config, "index_head_dim", default=0))
    heads = int(config.num_attention_heads)
    kv_heads = int(_get(config, "num_key_value_heads", default=heads))
    head_dim = int(_get(config, "head_dim", default=config.hidden_size // heads))
    return 2 * kv_heads * head_dim


def linear_state_elems(config) -> int:
    """Elements one linear-attention (or state-space) layer keeps per sequence; 0 when the family is not one
    this module knows (the caller marks the layout unknown)."""
    c = config
    if getattr(c, "linear_num_value_heads", None):  # gated DeltaNet (Qwen3-Next, Qwen3.5)
        kd, vd = int(c.linear_key_head_dim), int(c.linear_value_head_dim)
        kh, vh = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
        return vh * kd * vd + (2 * kh * kd + vh * vd) * (int(c.linear_conv_kernel_dim) - 1)
    if getattr(c, "linear_num_heads", None):  # Kimi Delta Attention
        h, d = int(c.linear_num_heads), int(c.linear_head_dim)
        return h * d * d + 3 * h * d * (int(c.linear_conv_kernel_dim) - 1)
    if getattr(c, "linear_attn_alpha_factor", None) is not None:  # MiniMax's lightning attention
        heads = int(c.num_attention_heads)
        d = int(_get(c, "head_dim", default=c.hidden_size // heads))
        return heads * d * d
    heads = _get(c, "mamba_n_heads", "mamba_num_heads")
    if heads:  # Mamba-2
        d_head = int(_get(c, "mamba_d_head", "mamba_head_dim"))
        d_state = int(_get(c, "mamba_d_state", "ssm_state_size"))
        groups = int(_get(c, "mamba_n_groups", "n_groups", default=1))
        d_inner = int(heads) * d_head
        kernel = int(_get(c, "mamba_d_conv", "conv_kernel", default=4))
        return int(heads) * d_head * d_state + (d_inner + 2 * groups * d_state) * (kernel - 1)
    if getattr(c, "mamba_d_state", None):  # Mamba-1 (Jamba)
        d_inner = int(c.mamba_expand) * int(c.hidden_size)
        return d_inner * int(c.mamba_d_state) + d_inner * (int(c.mamba_d_conv) - 1)
    return 0


def kv_layout(config, dtype_bytes: int) -> KvLayout:
    """The :class:`KvLayout` of a transformers (text) ``config`` at ``dtype_bytes`` per element."""
    types = _layer_types(config)
    token = state = 0
    windows: dict = {}
    unknown = []
    for t in types:
        if t in ATTENTION or t == "hybrid":
            token += attention_token_elems(config)
        if t in WINDOWED:
            w = int(getattr(config, WINDOWED[t], 0) or 0)
            if w > 0:
                windows[w] = windows.get(w, 0) + attention_token_elems(config)
            else:  # (a window of none: the layer holds every token)
                token += attention_token_elems(config)
        if t in ("linear_attention", "mamba", "hybrid"):
            s = linear_state_elems(config)
            if not s:
                unknown.append(t)
            state += s
        if t not in ATTENTION + EMPTY + tuple(WINDOWED) + ("linear_attention", "mamba", "hybrid"):
            unknown.append(t)
    why = ""
    if unknown:
        why = (f"{getattr(config, 'model_type', 'this model')}'s layer type(s) {', '.join(sorted(set(unknown)))}: "
               f"specmd does not know what their KV cache holds (specmd/models/kv.py)")
    return KvLayout(token * dtype_bytes, tuple(sorted((w, b * dtype_bytes) for w, b in windows.items())),
                    state * dtype_bytes, why)
