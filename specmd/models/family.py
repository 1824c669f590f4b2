"""What a model family is to specmd: the :class:`Adapter` record -- where a family keeps its MoE parts, how its
router scores and selects, its tiny configuration -- with its parts :class:`~specmd.models.hub.HubLayout` (how its
hub checkpoints name their tensors: :mod:`specmd.models.hub`), :class:`ExpertsLayout` (what its fused experts
compute beyond their weights) and :class:`RoutingReference` (the real model ``specmd card`` compares with), and
the per-call objects the hook hands a router (:class:`TokenIds`, :class:`RouterCall`). The records themselves
are in :mod:`specmd.models.adapters` (written) and :mod:`specmd.models.derive` (read off transformers' classes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..engine.geometry import Geometry
from ..engine.record import Scoring
from ..errors import ConfigError
from .hub import FROM_TRANSFORMERS, HubLayout, declared_hub


def _itemsize(dtype) -> int:
    """Bytes per element of a torch ``dtype`` (the model's compute dtype: what its KV cache holds)."""
    import torch

    return torch.empty((), dtype=dtype).element_size()


_DECLARED: dict = {}


def causal_lm_classes() -> dict:
    """transformers' model_type -> causal-LM class name mapping (the installed version's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def image_text_classes() -> dict:
    """transformers' model_type -> image-text-to-text class name mapping (vision-language wrappers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def build_config(model_type: str, over: dict):
    """``model_type``'s config class with ``over`` set; a sub-config given as a mapping (a wrapper's
    ``text_config``, ``vision_config``) is merged over the wrapper's own default for it, not over its class's."""
    from transformers import AutoConfig, PretrainedConfig

    config = AutoConfig.for_model(model_type)
    merged = {k: dict(getattr(config, k).to_dict(), **v)
              if isinstance(v, dict) and isinstance(getattr(config, k, None), PretrainedConfig) else v
              for k, v in over.items()}
    return AutoConfig.for_model(model_type, **merged)


@dataclass(frozen=True)
class ExpertsLayout:
    """What the experts kernels (:mod:`specmd.executor.kernel`) need of a family's fused experts module beyond
    its ``[E, ...]`` weights: the flags transformers' ``use_experts_implementation`` sets on the class,
    declared here so the kernels never probe a module (``tests/models/test_adapters.py`` checks each record against
    its family's module)."""

    gated: bool = True  # ``gate_up_proj`` through ``_apply_gate``; False: ``up_proj`` through ``act_fn``
    transposed: bool = False  # weights [E, in, out] (GPT-OSS), else [E, out, in]
    bias: bool = False  # per-expert biases ``<up>_bias`` [E, out] and ``down_proj_bias``
    post_norm: bool = False  # ``post_expert_norm`` applied to each expert's output
    # its own forward loops over experts, adding each one's outputs onto zeros in ascending id (Step-3.7), not
    # transformers' top-k sum in rank order: the kernels add in its order (the same bits)
    own_loop: bool = False
    # each expert runs on its input scaled by its weight, ``expert(x * w)`` (Llama-4's ``Llama4TextMoe``), its
    # output unweighted: the kernels scale the rows first (:mod:`specmd.models.contract`)
    input_weighted: bool = False

    @property
    def names(self) -> tuple[str, str, Optional[str], Optional[str]]:
        """(up weight, down weight, up bias, down bias) parameter names of the fused experts module."""
        up = "gate_up_proj" if self.gated else "up_proj"
        return up, "down_proj", (up + "_bias") if self.bias else None, "down_proj_bias" if self.bias else None


TOKEN_IDS = "input_ids"  # a router's forward parameter taking the pass's token ids (DeepSeek-V4's hash routers)


class TokenIds:
    """The token ids of the ongoing forward pass (``ids``: ``[B * S]`` long on the model's device, or None), as
    a hash-routed router reads them: the hook sets them at each pass's start."""

    __slots__ = ("ids",)

    def __init__(self, ids=None):
        self.ids = ids


class RouterCall:
    """A router whose block passes it some of its own attributes after the hidden states
    (:attr:`Adapter.router_args`), read from the block at each call (a ``model.to(device)`` replaces them), and
    the pass's token ids where it takes them (:data:`TOKEN_IDS`, read from ``tokens``), or that takes them as
    ``[1, T, H]`` (``batched``: AfMoE's router reads a sequence axis)."""

    __slots__ = ("router", "block", "args", "batched", "tokens", "ids_only")

    def __init__(self, router, block, args: tuple, batched: bool = False, tokens: Optional[TokenIds] = None):
        self.router, self.block, self.args, self.batched, self.tokens = router, block, args, batched, tokens
        self.ids_only = args == (TOKEN_IDS,)  # (DeepSeek-V4's hash routers: resolved once, not per call)

    def __call__(self, hidden):
        block = self.block
        if self.batched:
            hidden = hidden.unsqueeze(0)  # [1, T, H]
        if self.ids_only:
            return self.router.forward(hidden, self.tokens.ids)
        if len(self.args) == 1:
            return self.router.forward(hidden, getattr(block, self.args[0]))
        return self.router.forward(hidden, *[self.tokens.ids if a == TOKEN_IDS else getattr(block, a)
                                             for a in self.args])


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
    # router probabilities: "softmax", "sigmoid" or "sqrtsoftplus" (DeepSeek-V4) of the logits, or "probabilities":
    # the router's first output is its probabilities already (Gemma-4)
    score: str = "softmax"
    # top-k weights renormalised to sum 1: True / False / name of a bool config field
    renorm: object = True
    scale_attr: Optional[str] = None  # config field multiplying the top-k weights
    experts_attr: str = "num_experts"
    # config field holding the number of identity ("zero-computation") experts, router columns after the E experts
    # whose expert returns its input (LongCat-Flash's ``zero_expert_num``), or None: none
    identity_attr: Optional[str] = None
    topk_attr: str = "num_experts_per_tok"  # config field holding top-k (Aria's ``moe_topk``)
    # A small random config shaped like the family (experts dominate bytes; real E, k, shared experts).
    tiny: dict = field(default_factory=dict)
    # Weight semantics that reweigh() cannot reproduce exactly (documented deviation), else None.
    reweigh_note: Optional[str] = None
    # How its hub checkpoints name the tensors (loading them without transformers' loader, the disk tier, the
    # random checkpoint writer): FROM_TRANSFORMERS, what transformers' conversion mapping declares for the
    # family (:meth:`hub_layout`); a HubLayout; None: not mapped (such checkpoints load only through transformers).
    hub: object = FROM_TRANSFORMERS
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
    bias_path: str = ""  # the router's submodule holding it ("": the router; ERNIE-4.5's "moe_statics")
    group_score: Optional[str] = None
    groups_if: Optional[tuple] = None
    # What a left-out group scores (-inf; A.X-K2's router fills 0.0), and the router's [E]
    # parameter scaling each expert's weight after renormalisation (Gemma-4's ``per_expert_scale``), or None.
    group_fill: float = float("-inf")
    weight_scale_attr: Optional[str] = None
    bias_on_logits: bool = False  # the selection bias is added to the logits (Kolibri), not the probabilities
    # Attributes of the MoE block the router takes after the hidden states (MiniMax-M2, Hy3: the selection
    # bias lives on the block, ``gate(hidden, self.e_score_correction_bias)``); () for ``router(hidden)``.
    router_args: tuple = ()
    # The router takes the hidden states as [B, S, H] (AfMoE's reads a sequence axis), not [T, H]: a call on
    # another layer's input passes [1, T, H] (its outputs are [T, ...] either way).
    router_batched: bool = False
    # The decoder layer's attribute holding its MoE block (``mlp``; Granite's ``block_sparse_moe``, Jamba's
    # ``feed_forward``, Nemotron-H's ``mixer``; "": the layer is the block, Gemma-4's router and experts are
    # attributes of its decoder layer; a path: ERNIE-4.5-VL's text experts, ``mlp.text_moe``, beside its vision
    # experts); a layer whose block has no ``experts`` is dense.
    block_attr: str = "mlp"
    # Where the decoder (its ``layers``, embeddings and final norm) and the LM head sit in the model the family's
    # Auto class builds (:meth:`auto_class`): ``model`` and ``lm_head`` for a causal LM; a vision-language
    # wrapper's text decoder at ``model.language_model`` (Qwen3-VL-MoE, GLM-4.5V, Kimi-K2.5), Nemotron-H-Omni's at
    # ``language_model.model`` with its head at ``language_model.lm_head``.
    decoder_path: str = "model"
    head_path: str = "lm_head"

    def hub_layout(self) -> Optional[HubLayout]:
        """How the family's hub checkpoints name their tensors: ``hub``, or where it is FROM_TRANSFORMERS what
        transformers' conversion mapping declares for the family (:func:`declared_hub`, read off its tiny
        model built on the meta device, once per family), for a causal LM whose block is ``mlp`` (the layout
        :class:`HubLayout` renames); None otherwise."""
        if self.hub != FROM_TRANSFORMERS:
            return self.hub
        if self.family not in _DECLARED:
            _DECLARED[self.family] = self._declared_hub()
        return _DECLARED[self.family]

    def _declared_hub(self) -> Optional[HubLayout]:
        import torch
        from transformers.conversion_mapping import get_model_conversion_mapping

        if (self.block_attr, self.decoder_path, self.head_path) != ("mlp", "model", "lm_head"):
            return None
        with torch.device("meta"):
            model = self.auto_class().from_config(build_config(self.family, self.tiny))
        return declared_hub(get_model_conversion_mapping(model, add_legacy=False))

    # ---- model structure (nothing outside this module knows where a family keeps its parts) ----------
    def num_experts(self, config) -> int:
        return int(getattr(self.text(config), self.experts_attr))

    def top_k(self, config) -> int:
        return int(getattr(self.text(config), self.topk_attr))

    def identity_experts(self, config) -> int:
        """The identity experts' count (router columns E .. E + count - 1), 0 without."""
        return int(getattr(self.text(config), self.identity_attr) or 0) if self.identity_attr else 0

    def auto_class(self):
        """The transformers Auto class that builds the family from its config: ``AutoModelForCausalLM`` where
        transformers maps the family to a causal LM (a wrapper it maps there, Qwen3.5-MoE's or Llama-4's, builds
        its text model), else ``AutoModelForImageTextToText`` (a vision-language wrapper whose text decoder has
        no causal-LM class of its own: Qwen3-VL-MoE, GLM-4.5V, Kimi-K2.5)."""
        import transformers

        if self.family not in causal_lm_classes() and self.family in image_text_classes():
            return transformers.AutoModelForImageTextToText
        return transformers.AutoModelForCausalLM

    @staticmethod
    def text(config):
        """The text decoder's config of ``config`` (its ``text_config`` in a wrapper; itself otherwise): where E,
        top-k, the hidden size and the routing fields are read."""
        get = getattr(config, "get_text_config", None)
        return get(decoder=True) if get is not None else config

    def layers(self, model):
        """The decoder's layers (``ModuleList``)."""
        return self.decoder(model).layers

    def head(self, model):
        """The LM head (``[V, H]`` linear)."""
        return model.get_submodule(self.head_path)

    def moe_layers(self, model) -> list[int]:
        """Decoder-layer indices whose MLP is a routed MoE block."""
        layers = self.layers(model)
        ids = [i for i, layer in enumerate(layers) if hasattr(self._block_of(layer), "experts")]
        if not ids:
            raise ConfigError(f"no MoE layers found in {type(model).__name__} ({len(layers)} decoder "
                              f"layers): specmd caches the experts of an MoE model")
        return ids

    def block(self, model, layer_id: int):
        return self._block_of(self.layers(model)[layer_id])

    def _block_of(self, layer):
        block = layer
        for name in self.block_attr.split(".") if self.block_attr else ():  # (a path: ERNIE-4.5-VL's mlp.text_moe)
            block = getattr(block, name, None)
        return block

    def router(self, model, layer_id: int):
        return getattr(self.block(model, layer_id), self.router_attr)

    def bias_holder(self, model, layer_id: int):
        """The module holding the layer's selection bias (``bias_attr``): its router (or the router's
        ``bias_path`` submodule), or the block where the
        block passes it to the router (``router_args``)."""
        router = self.router(model, layer_id)
        if self.bias_path:
            return router.get_submodule(self.bias_path)
        return router if hasattr(router, self.bias_attr) else self.block(model, layer_id)

    def router_call(self, model, layer_id: int, tokens: Optional[TokenIds] = None):
        """``call(hidden [T, H]) -> (logits, weights, index)``: the layer's router as its block calls it, for
        running it on another layer's input (the prefetch signal); its forward hooks are bypassed. A hash-routed
        router (:meth:`hashed`) reads the pass's token ids from ``tokens``."""
        router = self.router(model, layer_id)
        args = self.router_args + ((TOKEN_IDS,) if self._takes_ids(router) else ())
        if not args and not self.router_batched:
            return router.forward
        return RouterCall(router, self.block(model, layer_id), args, self.router_batched, tokens)

    def hashed(self, model) -> tuple[int, ...]:
        """The MoE layers (ordinals among :meth:`moe_layers`) whose router takes the pass's token ids
        (:data:`TOKEN_IDS`): its choice is the token's, not its scores' top-k (DeepSeek-V4's hash routing)."""
        return tuple(j for j, i in enumerate(self.moe_layers(model)) if self._takes_ids(self.router(model, i)))

    @staticmethod
    def _takes_ids(router) -> bool:
        import inspect

        return TOKEN_IDS in inspect.signature(router.forward).parameters

    def experts(self, model, layer_id: int):
        return self.block(model, layer_id).experts

    def set_experts(self, model, layer_id: int, module) -> None:
        self.block(model, layer_id).experts = module

    def decoder(self, model):
        """The module whose forward is one forward pass (its pre/post hooks mark passes): the text decoder."""
        return model.get_submodule(self.decoder_path)

    def scoring(self, config, routers=(), hashed=()):
        """The family's :class:`~specmd.engine.record.Scoring` for ``config``; ``routers``: the modules holding
        the loaded model's selection bias (``bias_attr``), one per MoE layer (:meth:`bias_holder`: the router,
        or its block), which it reads (none given: no bias); ``hashed``: its hash-routed MoE layers
        (:meth:`hashed`)."""
        config = self.text(config)
        groups, topk_group = self.group_limit(config)
        return Scoring(self.score == "sigmoid", self.renormalises(config), self.scale(config),
                       self.selection_bias(routers), groups, topk_group, self.group_score or "top2",
                       given=self.score == "probabilities", group_fill=self.group_fill, on_logits=self.bias_on_logits,
                       expert_scale=self.selection_bias(routers, self.weight_scale_attr, fill=1.0)
                       if self.weight_scale_attr else None, sqrt_softplus=self.score == "sqrtsoftplus",
                       hashed=hashed)

    def group_limit(self, config) -> tuple[int, int]:
        """``(groups, kept groups)`` of the family's group-limited top-k under ``config``; (1, 1): none.
        Errors: ConfigError when the groups do not divide the experts or keep fewer experts than top-k."""
        if self.group_score is None:
            return 1, 1
        config = self.text(config)
        if self.groups_if is not None and getattr(config, self.groups_if[0], None) != self.groups_if[1]:
            return 1, 1
        groups, kept = int(getattr(config, "n_group", 1) or 1), int(getattr(config, "topk_group", 1) or 1)
        if groups <= 1 or kept >= groups:
            return 1, 1
        E, k = self.num_experts(config), self.top_k(config)
        if E % groups or kept * (E // groups) < k or kept < 1:
            raise ConfigError(f"model {config.model_type}: n_group={groups}, topk_group={kept} with {E} experts and "
                              f"top-k {k}: the groups must divide the experts and the kept groups hold >= top-k of them")
        return groups, kept

    def selection_bias(self, routers, attr: Optional[str] = None, fill: float = 0.0):
        """``[L, E]`` float32 on the host: each router's selection bias (``bias_attr``; or its ``attr``), or
        None when no router has one (a layer without: ``fill``, what adds nothing -- 1.0 for a weight scale)."""
        import torch

        attr = attr or self.bias_attr
        rows = [getattr(r, attr, getattr(getattr(r, self.router_attr, None), attr, None)) for r in routers]
        if not rows or all(b is None for b in rows):
            return None
        E = next(b for b in rows if b is not None).numel()
        return torch.stack([torch.full((E,), fill) if b is None else b.detach().float().cpu().reshape(-1)
                            for b in rows])

    def geometry(self, model):
        """The :class:`~specmd.engine.geometry.Geometry` of a loaded model (parameters at their dtype)."""
        import torch

        config = self.text(model.config)
        layers = self.layers(model)
        moe_ids = self.moe_layers(model)
        num_experts = self.num_experts(config)
        if num_experts < 1:  # a model.tiny override can build one (num_experts=0)
            raise ConfigError(f"model {config.model_type} has {num_experts} experts per MoE layer: specmd caches the "
                              f"experts of an MoE model (check model.tiny)")
        from ..executor.kernel import expert_tensors
        from .kv import kv_layout

        def per_expert(i):  # the experts module's [E, ...] tensors: what an expert is (a norm they share is dense,
            return list(expert_tensors(self.experts(model, i), num_experts).values())  # MuSe-Spark's post norm)

        tensors = per_expert(moe_ids[0])
        expert_params = sum(p.numel() for p in tensors) // num_experts
        expert_bytes = sum(p.numel() * p.element_size() for p in tensors) // num_experts
        dtype_bytes = tensors[0].element_size()
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        def dense_params(i):  # (another expert set of the layer -- ERNIE-4.5-VL's vision experts -- a text run never
            n = sum(p.numel() for p in layers[i].parameters())  # routes to: not its dense compute either)
            block = self._block_of(layers[i])
            idle = sum(p.numel() for m in layers[i].modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)
                       and m is not block for p in m.experts.parameters())
            return n - idle - (sum(p.numel() for p in per_expert(i)) if i in moe_ids else 0)

        dense, attn, prev = [], [], -1
        for i in moe_ids:
            dense.append(sum(dense_params(j) for j in range(prev + 1, i + 1)))
            attn.append(i - prev)
            prev = i
        tail = sum(dense_params(j) for j in range(prev + 1, len(layers)))
        tail += self._final_params(model) + self.head(model).weight.numel()
        return Geometry(
            num_layers=len(moe_ids), num_experts=num_experts, top_k=self.top_k(config),
            expert_bytes=expert_bytes, total_bytes=total_bytes, hidden_size=int(config.hidden_size),
            dtype_bytes=dtype_bytes, dense_params=dense, attn_layers=attn, tail_params=tail,
            tail_attn_layers=len(layers) - 1 - prev, expert_params=expert_params, layer_ids=moe_ids,
            identity_experts=self.identity_experts(config), kv=kv_layout(config, _itemsize(model.dtype)).to_dict(),
        )

    def _final_params(self, model) -> int:
        """Parameters of the decoder after its layers: the final norm (``model.model.norm``, or whatever the
        decoder holds besides its embeddings and layers: Jamba's ``final_layernorm``, Nemotron-H's ``norm_f``)."""
        decoder = self.decoder(model)
        if hasattr(decoder, "norm"):
            return sum(p.numel() for p in decoder.norm.parameters())
        return sum(p.numel() for n, p in decoder.named_parameters()
                   if not n.startswith(("layers.", "embed_tokens.", "embeddings.")))

    def renormalises(self, config) -> bool:
        return bool(getattr(self.text(config), self.renorm)) if isinstance(self.renorm, str) else bool(self.renorm)

    def scale(self, config) -> float:
        return float(getattr(self.text(config), self.scale_attr)) if self.scale_attr else 1.0
