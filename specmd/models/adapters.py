"""Model-family adapters: the only place that knows a family's name and layout.

Every transformers 5.x MoE family has ``model.model.layers[i].mlp`` with a router (``.gate`` or
``.router``) returning ``(router_logits [T,E], top_k_weights [T,k], top_k_index [T,k])`` and fused experts
at ``.experts`` called as ``experts(hidden [T,H], top_k_index, top_k_weights)``. What differs is declared
here as data: where the router lives, how logits become router probabilities, whether the top-k weights
are renormalised and scaled, which config fields hold E and k, the tiny test configuration, how the family's
hub checkpoints name its tensors (:class:`HubLayout`) and what its fused experts module computes beyond its
weights (:class:`ExpertsLayout`). A family is one :class:`Adapter` record in :data:`ADAPTERS`: loading, the
disk tier, the random checkpoint writer, the experts kernels, training and the tests read it from here and
keep no table of their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ..engine.geometry import Geometry
from ..engine.record import Scoring
from ..errors import ConfigError

_BLOCK = re.compile(r"^(?P<pre>.*\.layers\.\d+)\.mlp\.(?P<rest>.*)$")  # a decoder layer's MoE block


@dataclass(frozen=True)
class HubLayout:
    """How a family's Hugging Face hub checkpoints name what transformers renames and fuses on load (and
    ``save_pretrained`` converts back): the MoE block (``mlp`` in transformers), the router when the hub
    calls it ``gate``, and the per-expert projections that transformers fuses into ``gate_up_proj``
    [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I]. One record serves both directions, so what the
    random checkpoint writer names (:meth:`to_hub`) is what loading (:meth:`from_hub`) and the disk tier
    (:meth:`expert_parts`) read."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    router: Optional[str] = None  # transformers' router module, when the hub calls it ``gate``

    def to_hub(self, name: str) -> str:
        """A transformers tensor name (not a fused expert tensor) under the hub's name."""
        m = _BLOCK.match(name)
        if m is None:
            return name
        rest = m["rest"]
        if self.router and rest.startswith(self.router + "."):
            rest = "gate." + rest[len(self.router) + 1:]
        return f"{m['pre']}.{self.block}.{rest}"

    def from_hub(self, name: str) -> str:
        """A hub tensor name (not a per-expert tensor) under transformers' name: the inverse of :meth:`to_hub`."""
        if self.block == "mlp":
            return name
        if self.router:
            name = name.replace(f".{self.block}.gate.", f".mlp.{self.router}.")
        return name.replace(f".{self.block}.", ".mlp.")

    def expert_parts(self, fused: str) -> tuple[str, ...]:
        """The hub's per-expert tensors (after ``experts.{e}.``) whose rows, concatenated in order, are expert
        ``e`` of transformers' fused parameter ``fused``; () when the hub keeps it fused too."""
        parts = {"gate_up_proj": (self.gate, self.up), "down_proj": (self.down,), "up_proj": (self.up,)}
        return tuple(f"{p}.weight" for p in parts.get(fused, ()))


@dataclass(frozen=True)
class ExpertsLayout:
    """What the experts kernels (:mod:`specmd.executor.kernel`) need of a family's fused experts module beyond
    its ``[E, ...]`` weights: the flags transformers' ``use_experts_implementation`` sets on the class,
    declared here so the kernels never probe a module (``tests/test_adapters.py`` checks each record against
    its family's module)."""

    gated: bool = True  # ``gate_up_proj`` through ``_apply_gate``; False: ``up_proj`` through ``act_fn``
    transposed: bool = False  # weights [E, in, out] (GPT-OSS), else [E, out, in]
    bias: bool = False  # per-expert biases ``<up>_bias`` [E, out] and ``down_proj_bias``
    post_norm: bool = False  # ``post_expert_norm`` applied to each expert's output

    @property
    def names(self) -> tuple[str, str, Optional[str], Optional[str]]:
        """(up weight, down weight, up bias, down bias) parameter names of the fused experts module."""
        up = "gate_up_proj" if self.gated else "up_proj"
        return up, "down_proj", (up + "_bias") if self.bias else None, "down_proj_bias" if self.bias else None



@dataclass(frozen=True)
class RoutingReference:
    """A real model whose routing ``specmd card`` compares a model of its family with: the statistics the data
    mirror holds (``routing_stats/olmoe_paper/<mirror_dir>``: its MoE ``layers``, ``top_k``), and, where it was
    measured, its per-token locality (``locality``: ``mean`` over layers, ``min`` of a layer, the ``model``
    measured and the ``source``), the bound a shipped model of its shape (``num_experts``, ``top_k``) meets."""

    mirror_dir: str
    model: str
    layers: int
    top_k: int
    num_experts: int
    locality: Optional[dict] = None

@dataclass(frozen=True)
class Adapter:
    family: str  # transformers model_type
    router_attr: str = "gate"
    score: str = "softmax"  # router probabilities: "softmax" or "sigmoid" over the logits
    # top-k weights renormalised to sum 1: True / False / name of a bool config field
    renorm: object = True
    scale_attr: Optional[str] = None  # config field multiplying the top-k weights
    experts_attr: str = "num_experts"
    # A small random config shaped like the family (experts dominate bytes; real E, k, shared experts).
    tiny: dict = field(default_factory=dict)
    # Weight semantics that reweigh() cannot reproduce exactly (documented deviation), else None.
    reweigh_note: Optional[str] = None
    # How its hub checkpoints name the tensors (loading them without transformers' loader, the disk tier, the
    # random checkpoint writer); None: not mapped (such checkpoints load only through transformers).
    hub: Optional[HubLayout] = HubLayout()
    # What its fused experts module computes beyond its weights (read by the experts kernels).
    experts_layout: ExpertsLayout = ExpertsLayout()
    # The real model whose routing a model of this family is compared with (specmd card).
    routing_reference: Optional[RoutingReference] = None
    # The selection rule beyond the score function (Scoring): the router's buffer holding a per-expert
    # selection bias, read from the loaded model wherever the router has it (absent or all zero: none); and
    # group-limited top-k -- how a group is scored ("top2": the sum of its two best scores, "max": its best),
    # with E split into config.n_group groups of which config.topk_group are kept -- or None (no groups), and
    # the (config field, value) under which the groups apply (DeepSeek-V2: topk_method=group_limited_greedy).
    bias_attr: str = "e_score_correction_bias"
    group_score: Optional[str] = None
    groups_if: Optional[tuple] = None

    # ---- model structure (nothing outside this module knows where a family keeps its parts) ----------
    def num_experts(self, config) -> int:
        return int(getattr(config, self.experts_attr))

    def moe_layers(self, model) -> list[int]:
        """Decoder-layer indices whose MLP is a routed MoE block."""
        ids = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
        if not ids:
            raise ConfigError(f"no MoE layers found in {type(model).__name__} ({len(model.model.layers)} decoder "
                              f"layers): specmd caches the experts of an MoE model")
        return ids

    def block(self, model, layer_id: int):
        return model.model.layers[layer_id].mlp

    def router(self, model, layer_id: int):
        return getattr(self.block(model, layer_id), self.router_attr)

    def experts(self, model, layer_id: int):
        return self.block(model, layer_id).experts

    def set_experts(self, model, layer_id: int, module) -> None:
        self.block(model, layer_id).experts = module

    def decoder(self, model):
        """The module whose forward is one forward pass (its pre/post hooks mark passes)."""
        return model.model

    def scoring(self, config, routers=()):
        """The family's :class:`~specmd.engine.record.Scoring` for ``config``; ``routers``: the loaded model's
        routers, one per MoE layer, whose selection bias (``bias_attr``) it reads (none given: no bias)."""
        groups, topk_group = self.group_limit(config)
        return Scoring(self.score == "sigmoid", self.renormalises(config), self.scale(config),
                       self.selection_bias(routers), groups, topk_group, self.group_score or "top2")

    def group_limit(self, config) -> tuple[int, int]:
        """``(groups, kept groups)`` of the family's group-limited top-k under ``config``; (1, 1): none.
        Errors: ConfigError when the groups do not divide the experts or keep fewer experts than top-k."""
        if self.group_score is None:
            return 1, 1
        if self.groups_if is not None and getattr(config, self.groups_if[0], None) != self.groups_if[1]:
            return 1, 1
        groups, kept = int(getattr(config, "n_group", 1) or 1), int(getattr(config, "topk_group", 1) or 1)
        if groups <= 1 or kept >= groups:
            return 1, 1
        E, k = self.num_experts(config), int(config.num_experts_per_tok)
        if E % groups or kept * (E // groups) < k or kept < 1:
            raise ConfigError(f"model {config.model_type}: n_group={groups}, topk_group={kept} with {E} experts and "
                              f"top-k {k}: the groups must divide the experts and the kept groups hold >= top-k of them")
        return groups, kept

    def selection_bias(self, routers):
        """``[L, E]`` float32 on the host: each router's selection bias (``bias_attr``), or None when no
        router has one."""
        import torch

        rows = [getattr(r, self.bias_attr, None) for r in routers]
        if not rows or all(b is None for b in rows):
            return None
        E = next(b for b in rows if b is not None).numel()
        return torch.stack([torch.zeros(E) if b is None else b.detach().float().cpu().reshape(-1) for b in rows])

    def geometry(self, model):
        """The :class:`~specmd.engine.geometry.Geometry` of a loaded model (parameters at their dtype)."""
        config = model.config
        layers = model.model.layers
        moe_ids = self.moe_layers(model)
        num_experts = self.num_experts(config)
        if num_experts < 1:  # a model.tiny override can build one (num_experts=0)
            raise ConfigError(f"model {config.model_type} has {num_experts} experts per MoE layer: specmd caches the "
                              f"experts of an MoE model (check model.tiny)")
        experts0 = self.experts(model, moe_ids[0])
        expert_params = sum(p.numel() for p in experts0.parameters()) // num_experts
        expert_bytes = sum(p.numel() * p.element_size() for p in experts0.parameters()) // num_experts
        dtype_bytes = next(experts0.parameters()).element_size()
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        def dense_params(i):
            n = sum(p.numel() for p in layers[i].parameters())
            return n - (sum(p.numel() for p in self.experts(model, i).parameters()) if i in moe_ids else 0)

        dense, attn, prev = [], [], -1
        for i in moe_ids:
            dense.append(sum(dense_params(j) for j in range(prev + 1, i + 1)))
            attn.append(i - prev)
            prev = i
        tail = sum(dense_params(j) for j in range(prev + 1, len(layers)))
        tail += sum(p.numel() for p in model.model.norm.parameters()) + model.lm_head.weight.numel()
        return Geometry(
            num_layers=len(moe_ids), num_experts=num_experts, top_k=int(config.num_experts_per_tok),
            expert_bytes=expert_bytes, total_bytes=total_bytes, hidden_size=int(config.hidden_size),
            dtype_bytes=dtype_bytes, dense_params=dense, attn_layers=attn, tail_params=tail,
            tail_attn_layers=len(layers) - 1 - prev, expert_params=expert_params, layer_ids=moe_ids,
        )

    def renormalises(self, config) -> bool:
        return bool(getattr(config, self.renorm)) if isinstance(self.renorm, str) else bool(self.renorm)

    def scale(self, config) -> float:
        return float(getattr(config, self.scale_attr)) if self.scale_attr else 1.0


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
                hub=HubLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
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
                hub=HubLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2", router="router"),
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
        # [E, in, out] with biases; its hub checkpoints (MXFP4 blocks) are not mapped.
        Adapter("gpt_oss", router_attr="router", renorm=True, experts_attr="num_local_experts", hub=None,
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
    classes (:mod:`specmd.models.derive`; ~0.1 s a family, once per process)."""
    from .derive import derive, moe_families

    return [f for f in moe_families() if f not in ADAPTERS and derive(f).adapter is not None]


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
