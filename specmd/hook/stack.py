"""Installing a policy stack into a transformers MoE model (SpecMD Algorithm 1).

Per MoE layer call:
1. a forward hook on the router builds the :class:`GateRecord` and lets the routing policy change the
   selection (dual-logit semantics: new selection, original probabilities as weights);
2. the block calls the experts, which are replaced by :class:`SpecmdExperts`: the cache manager serves
   the requested experts (hits, misses through the miss policy, evictions, stalls on the clock), the
   allowed experts run through the family's own fused kernel, and the prefetch policy queues predictions
   for later layers on the transfer channel while the experts compute;
3. pre/post hooks on the decoder mark forward passes (prefill or decode) for per-pass accounting.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..cache.manager import CacheManager, Geometry, pool_capacities
from ..clock import Roofline, SimClock, TransferChannel
from ..hardware import HardwareConfig
from ..models.adapters import Adapter
from ..quant.base import ExpertStore, QuantMethod
from .gate import GateRecord, Scoring


class SpecmdExperts(nn.Module):
    """Stands in for ``mlp.experts`` with the same call signature. The original fused module is kept as
    ``inner`` and is the host store of the experts at their stored precision: ``inner.gate_up_proj[e]``
    and ``inner.down_proj[e]`` are views of expert ``e``."""

    def __init__(self, inner: nn.Module, layer: int, stack: "PolicyStack"):
        super().__init__()
        self.inner = inner
        self.layer = layer
        self.__dict__["stack"] = stack  # not a submodule
        self.num_experts = stack.view.num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.stack.run_layer(self, hidden_states, top_k_index, top_k_weights)


class ModelView:
    """What policies may know about the model: layer structure and later routers (no family names)."""

    def __init__(self, routers: list[nn.Module], scoring: Scoring, num_experts: int, top_k: int, layer_ids,
                 store: Optional[ExpertStore] = None):
        self.routers = routers
        self.scoring = scoring
        self.num_layers = len(routers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.layer_ids = list(layer_ids)
        self.store = store  # stored precisions of the experts and their bytes

    def next_layer(self, layer: int) -> Optional[int]:
        return layer + 1 if layer + 1 < self.num_layers else None

    @torch.no_grad()
    def router_predict(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s router applied to ``hidden`` [T, H], hooks bypassed: its probabilities [T, E]
        and its own top-k selection [T, k] (with the family's rules: group limits, sparsemixer, biases)."""
        logits, _, index = self.routers[layer].forward(hidden)
        return self.scoring.probs(logits), index

    def router_probs(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.router_predict(layer, hidden)[0]


def geometry(model: nn.Module, adapter: Adapter) -> tuple[Geometry, list[int]]:
    config = model.config
    layers = model.model.layers
    moe_ids = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    if not moe_ids:
        raise ValueError(f"no MoE layers found in {type(model).__name__}")
    num_experts = int(getattr(config, adapter.experts_attr))
    experts0 = layers[moe_ids[0]].mlp.experts
    expert_params = sum(p.numel() for p in experts0.parameters()) // num_experts
    expert_bytes = sum(p.numel() * p.element_size() for p in experts0.parameters()) // num_experts
    dtype_bytes = next(experts0.parameters()).element_size()
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def dense_params(i):
        mlp = layers[i].mlp
        n = sum(p.numel() for p in layers[i].parameters())
        return n - (sum(p.numel() for p in mlp.experts.parameters()) if hasattr(mlp, "experts") else 0)

    dense, attn, prev = [], [], -1
    for i in moe_ids:
        dense.append(sum(dense_params(j) for j in range(prev + 1, i + 1)))
        attn.append(i - prev)
        prev = i
    tail = sum(dense_params(j) for j in range(prev + 1, len(layers)))
    tail += sum(p.numel() for p in model.model.norm.parameters()) + model.lm_head.weight.numel()
    geom = Geometry(
        num_layers=len(moe_ids), num_experts=num_experts, top_k=int(config.num_experts_per_tok),
        expert_bytes=expert_bytes, total_bytes=total_bytes, hidden_size=int(config.hidden_size),
        dtype_bytes=dtype_bytes, dense_params=dense, attn_layers=attn, tail_params=tail,
        tail_attn_layers=len(layers) - 1 - prev, expert_params=expert_params, layer_ids=moe_ids,
    )
    return geom, moe_ids


class PolicyStack:
    def __init__(self, model, adapter: Adapter, routing, miss, make_eviction, prefetch, hardware: HardwareConfig,
                 quant: Optional[QuantMethod] = None):
        self.model = model
        self.adapter = adapter
        self.routing = routing
        self.miss = miss
        self.prefetch = prefetch
        self.hardware = hardware
        self.geom, self.moe_ids = geometry(model, adapter)
        config = model.config
        self.scoring = Scoring(adapter.score == "sigmoid", adapter.renormalises(config), adapter.scale(config))
        layers = model.model.layers
        self.routers = [getattr(layers[i].mlp, adapter.router_attr) for i in self.moe_ids]
        if quant is None:
            from ..quant.none import NoQuant

            quant = NoQuant()
        tag = f"{getattr(config, '_name_or_path', '')}|{type(model).__name__}|{next(model.parameters()).dtype}"
        self.store = quant.build([layers[i].mlp.experts for i in self.moe_ids], self.geom.num_experts, tag)
        self.view = ModelView(self.routers, self.scoring, self.geom.num_experts, self.geom.top_k, self.moe_ids,
                              self.store)
        for policy in (routing, miss, prefetch):
            policy.setup(self.view)
        channel = TransferChannel(hardware.bandwidth_gbps * 1e9, hardware.latency_us * 1e-6)
        roofline = Roofline(hardware.peak_tflops * 1e12, hardware.mem_bandwidth_gbps * 1e9)
        self.clock = SimClock(channel, roofline)
        caps = pool_capacities(self.geom, hardware.capacity, hardware.experts_per_layer, hardware.scope)
        host = Roofline(hardware.host_tflops * 1e12, hardware.host_mem_bandwidth_gbps * 1e9)
        g = self.geom

        def host_time(slots: int, experts: int) -> float:
            return host.time(2.0 * slots * g.expert_params, experts * g.expert_bytes)

        self.cache = CacheManager(self.geom, caps, make_eviction, miss, self.clock, self.store, host_time)
        self.records: list[Optional[GateRecord]] = [None] * self.geom.num_layers
        self.trace: Optional[list] = None  # set to [[] per layer] to record the router's own top-k per token
        self._handles = []
        self._originals = []

    # ---- install / remove ---------------------------------------------------------------------------
    def install(self) -> "PolicyStack":
        layers = self.model.model.layers
        for ordinal, i in enumerate(self.moe_ids):
            mlp = layers[i].mlp
            self._originals.append((mlp, mlp.experts))
            mlp.experts = SpecmdExperts(mlp.experts, ordinal, self)
            h = self.routers[ordinal].register_forward_hook(self._router_hook(ordinal), prepend=True)
            self._handles.append(h)
        base = self.model.model
        self._handles.append(base.register_forward_pre_hook(self._pass_start, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._pass_end))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for mlp, experts in self._originals:
            mlp.experts = experts
        self._handles, self._originals = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    # ---- forward passes -------------------------------------------------------------------------------
    def _pass_start(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        batch, seq = int(ids.shape[0]), int(ids.shape[1])
        past = kwargs.get("past_key_values")
        past_len = int(past.get_seq_length()) if past is not None else 0
        kind = "decode" if past_len > 0 else "prefill"
        self.cache.begin_pass(kind, batch * seq, past_len + seq)

    def _pass_end(self, module, args, output):
        self.cache.end_pass()

    def _router_hook(self, layer: int):
        records = self.records
        routing = self.routing
        scoring = self.scoring
        cache = self.cache

        def hook(module, args, output):
            logits, weights, index = output
            hidden = args[0]
            hidden = hidden.reshape(-1, hidden.shape[-1])
            rec = GateRecord(layer, hidden, logits, weights, index, scoring)
            records[layer] = rec
            new_index = routing.apply(rec, cache)
            if new_index is None:
                return None
            rec.index = new_index
            rec.weights = routing.weigh(rec, new_index).to(weights.dtype)
            return logits, rec.weights, new_index

        return hook

    # ---- one MoE layer call ------------------------------------------------------------------------------
    def run_layer(self, mod: SpecmdExperts, hidden, index, weights):
        layer = mod.layer
        cache = self.cache
        rec = self.records[layer]
        if self.trace is not None:
            self.trace[layer].append(rec.original.detach().cpu())
        cache.dense(layer)
        counts = torch.bincount(index.reshape(-1), minlength=self.geom.num_experts)
        experts = counts.nonzero().squeeze(1).tolist()
        served = cache.serve(layer, experts, rec, cache)
        slots = index.numel()
        st = cache.stats
        st.slots_total += slots
        n_run = len(experts)
        rerouted = rec.index is not rec.original
        # the router's own requests: what was just counted, unless a routing policy changed the selection
        st.requests_router[layer] += int(torch.bincount(rec.original.reshape(-1)).count_nonzero()) if rerouted else n_run
        if served is None and not rerouted:
            st.slots_unchanged += slots
        else:
            if rerouted:
                kept = (index.unsqueeze(-1) == rec.original.unsqueeze(-2)).any(-1)
                void = weights == 0  # slots a routing policy emptied (prune): not run, not faithful
                if bool(void.any()):
                    kept &= ~void
                    slots -= int(void.sum())
            else:
                kept = torch.ones_like(index, dtype=torch.bool)
            if served is not None:
                index, weights, kept, slots, n_run = self._apply_served(served, index, weights, kept, counts, n_run,
                                                                        slots)
            st.slots_unchanged += int(kept.sum())
        for target, predicted in self.prefetch.predict(rec, self.view):
            cache.prefetch(target, predicted)
        cache.compute_experts(layer, slots, n_run)
        if served is not None and served.precisions:
            out = self._run_lossy(mod, served, hidden, index, weights)
        else:
            out = mod.inner(hidden, index, weights)
        cache.finish_layer()
        return out

    def _apply_served(self, served, index, weights, kept, counts, n_run, slots):
        """Substitutions change the index, drops zero the weights (no renormalisation), host-computed
        experts leave the device's compute; returns the new index/weights and the device's share."""
        for e, sub in served.substitutes.items():
            hit = index == e
            index = torch.where(hit, sub.to(index.device).unsqueeze(-1).expand_as(index), index)
            kept &= ~hit
        if served.substitutes:
            counts = torch.bincount(index.reshape(-1), minlength=self.geom.num_experts)
            n_run = int((counts > 0).sum())
        if served.dropped:
            mask = torch.isin(index, torch.tensor(served.dropped, dtype=index.dtype, device=index.device))
            weights = weights.masked_fill(mask, 0)
            kept &= ~mask
            slots -= int(mask.sum())
            n_run -= len(served.dropped)
        if served.host:
            slots -= int(sum(int(counts[e]) for e in served.host))
            n_run -= len(served.host)
        return index, weights, kept, slots, n_run

    def _run_lossy(self, mod, served, hidden, index, weights):
        """Run the layer with the listed experts' weights replaced by their stored low-precision copies
        (dequantized HQQ weights: the real quantized expert computes), then restore the native ones."""
        inner = mod.inner
        saved = []
        try:
            for e, prec in served.precisions.items():
                for name, w in self.store.weights(mod.layer, e, prec).items():
                    p = getattr(inner, name)
                    saved.append((p, e, p.data[e].clone()))
                    p.data[e].copy_(w)
            return inner(hidden, index, weights)
        finally:
            for p, e, old in reversed(saved):
                p.data[e].copy_(old)


def install(model, adapter: Adapter, routing, miss, make_eviction, prefetch, hardware: HardwareConfig,
            quant: Optional[QuantMethod] = None) -> PolicyStack:
    return PolicyStack(model, adapter, routing, miss, make_eviction, prefetch, hardware, quant).install()
