"""Model-family adapters: the only place that knows a family's name and layout.

Every transformers 5.x MoE family has ``model.model.layers[i].mlp`` with a router (``.gate`` or
``.router``) returning ``(router_logits [T,E], top_k_weights [T,k], top_k_index [T,k])`` and fused experts
at ``.experts`` called as ``experts(hidden [T,H], top_k_index, top_k_weights)``. What differs is declared
here as data: where the router lives, how logits become router probabilities, whether the top-k weights
are renormalised and scaled, which config fields hold E and k, the tiny test configuration and what its fused
experts module computes beyond its weights (:class:`ExpertsLayout`); how its hub checkpoints name their
tensors (:class:`HubLayout`) is read from transformers' own conversion mapping (:meth:`Adapter.hub_layout`).
A family is one :class:`Adapter` record in :data:`ADAPTERS`: loading, the disk tier, the random checkpoint
writer, the experts kernels, training and the tests read it from here and keep no table of their own.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from .family import Adapter, ExpertsLayout, RoutingReference  # noqa: F401  (the record's parts, re-exported)
from .hub import HubLayout  # noqa: F401  (re-exported)

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
               max_position_embeddings=2048, vocab_size=260, tie_word_embeddings=False,
               bos_token_id=256, eos_token_id=257, pad_token_id=258)

ADAPTERS: dict[str, Adapter] = {
    a.family: a
    for a in [
        # OLMoE-1B-7B: 64 experts, top-8, softmax, no renorm.
        Adapter("olmoe", renorm="norm_topk_prob", experts_attr="num_experts",
                routing_reference=RoutingReference("olmoe", "OLMoE-1B-7B", 16, 8, 64),
                tiny=dict(_COMMON, intermediate_size=32, num_experts=64, num_experts_per_tok=8,
                          norm_topk_prob=False)),
        # Mixtral-8x7B: 8 experts, top-2, renormalised softmax.
        Adapter("mixtral", renorm=True, experts_attr="num_local_experts",
                routing_reference=RoutingReference("mistral", "Mixtral-8x7B", 32, 2, 8, locality={
                    "model": "Mixtral-8x7B-Instruct", "mean": 0.376, "min": 0.259,
                    "source": "vLLM decode routing capture, 577 tokens x 32 layers (issue 18)"}),
                tiny=dict(_COMMON, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
        # Qwen1.5-MoE-A2.7B: 60 experts, top-4, plus a gated shared expert (always resident).
        Adapter("qwen2_moe", renorm="norm_topk_prob", experts_attr="num_experts",
                tiny=dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=60,
                          num_experts_per_tok=4, shared_expert_intermediate_size=128, norm_topk_prob=False)),
        # Qwen3-30B-A3B: 128 experts, top-8, renormalised.
        Adapter("qwen3_moe", renorm="norm_topk_prob", experts_attr="num_experts",
                tiny=dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, head_dim=16)),
        # Phi-3.5-MoE: 16 experts, top-2 through sparsemixer.
        Adapter("phimoe", router_attr="router", renorm=True, experts_attr="num_local_experts",
                tiny=dict(_COMMON, intermediate_size=128, num_local_experts=16, num_experts_per_tok=2),
                reweigh_note="sparsemixer weights each pick by a softmax over logits within a jitter "
                             "threshold of it; reweigh() uses the renormalised full softmax instead"),
        # DeepSeek-V2-Lite: 64 experts, top-6, 2 shared experts, first layer dense, softmax, scaled.
        Adapter("deepseek_v2", renorm=False, scale_attr="routed_scaling_factor", experts_attr="n_routed_experts",
                group_score="max", groups_if=("topk_method", "group_limited_greedy"),
                tiny=dict(_COMMON, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=64,
                          num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
                          topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                          kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                          v_head_dim=16, num_key_value_heads=4)),
        # DeepSeek-V3: 256 experts, top-8, 1 shared, group-limited sigmoid routing, renormalised, scaled.
        Adapter("deepseek_v3", score="sigmoid", renorm="norm_topk_prob", scale_attr="routed_scaling_factor",
                experts_attr="n_routed_experts", group_score="top2",
                tiny=dict(_COMMON, intermediate_size=128, moe_intermediate_size=16, n_routed_experts=256,
                          num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=8,
                          topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=32,
                          q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                          num_key_value_heads=4)),
        # GPT-OSS-20B: 32 experts, top-4, softmax over the top-k logits (= renormalised softmax); experts
        # [E, in, out] with biases; its hub checkpoints (MXFP4 blocks) are not mapped (transformers declares no
        # conversion for them: hub_layout() is None).
        Adapter("gpt_oss", router_attr="router", renorm=True, experts_attr="num_local_experts",
                experts_layout=ExpertsLayout(transposed=True, bias=True),
                tiny=dict(_COMMON, intermediate_size=64, num_local_experts=32, num_experts_per_tok=4,
                          head_dim=16, sliding_window=64, max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"] * 2)),
    ]
}


def families() -> list[str]:
    """The families with a record, in :data:`ADAPTERS`' order (what training and the tests enumerate);
    :func:`derived_families` are the others the installed transformers ships that run."""
    return list(ADAPTERS)


def derived_families() -> list[str]:
    """The MoE families of the installed transformers that run without a record, derived from their own
    classes (:mod:`specmd.models.derive`; ~0.1 s a family, once per process); a wrapper whose checkpoints run
    as its text model (``qwen3_5_moe`` as ``qwen3_5_moe_text``) is not listed again."""
    from .derive import derive, moe_families

    return [f for f in moe_families() if f not in ADAPTERS and derive(f).adapter is not None and not derive(f).runs_as]


def adapter_for(family: str) -> Adapter:
    """``family``'s record, or its record derived from transformers' own classes. Errors: ConfigError
    naming the family, why it does not run, and the families with a record."""
    if family in ADAPTERS:
        return ADAPTERS[family]
    from .derive import derive

    derived = derive(family)
    if derived.adapter is None:
        raise ConfigError(f"model family {family!r} does not run: {derived.reason}; families with a record: "
                          f"{', '.join(ADAPTERS)} (and those derived from the installed transformers)")
    return derived.adapter


def measured_locality(num_experts: int, top_k: int) -> Optional[dict]:
    """The measured per-token locality of the real model of this shape (a family's
    :attr:`RoutingReference.locality`), or None where none was measured."""
    for adapter in ADAPTERS.values():
        ref = adapter.routing_reference
        if ref is not None and ref.locality and (ref.num_experts, ref.top_k) == (num_experts, top_k):
            return ref.locality
    return None
