"""The live driver: hooks a transformers MoE model so that its layer calls drive the engine.

Per MoE layer call (SpecMD Algorithm 1):
1. a forward hook on the router reads the call's routing back to the host -- with the prefetch signal of
   later layers and the logits when the stack reads them, in **one** device-to-host copy
   (:mod:`.readback`: the only synchronisation of a hooked layer call) -- builds the
   :class:`~specmd.engine.record.LiveRecord` from it and lets the engine apply the routing policy
   (dual-logit semantics: new selection, original probabilities as weights);
2. the block calls its experts, replaced by :class:`SpecmdExperts`: the engine serves the layer call
   (cache, miss outcomes, prefetch, clock) and says how the experts run; the executor (``execution``:
   simulated or offload, :mod:`specmd.executor`) runs them;
3. pre/post hooks on the decoder mark forward passes (prefill or decode) and find their live positions
   (:mod:`.live`): a batch's pad positions and finished sequences are no requests, so the record holds the
   live rows only (the device tensors keep every row; the executor is told which are live). A pass with no
   live position at all is no pass: the engine never sees it.
The hook decides no cache question; model structure comes from the family's adapter.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..engine import GROUPS, Engine, LiveRecord, StackSpec
from ..executor.base import upload
from ..models.adapters import Adapter, adapter_for
from ..models.contract import adopt
from ..models.family import TokenIds


class SpecmdExperts(nn.Module):
    """Stands in for ``mlp.experts`` with the same call signature. The original fused module is kept as
    ``inner`` and is the host store of the experts at their stored precision."""

    def __init__(self, inner: nn.Module, layer: int, stack: "PolicyStack"):
        super().__init__()
        if not stack.executor.device_experts:  # not a submodule: model.to(device) leaves the experts in their host tier
            self.__dict__["inner"] = inner
        else:
            self.inner = inner
        self.layer = layer
        self.__dict__["stack"] = stack  # not a submodule

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.stack.run_layer(self, hidden_states, top_k_index, top_k_weights)


class LiveSignal:
    """The prefetch signal of one live layer call: later layers' routers applied to its router input (hooks
    bypassed). The targets the stack reads were computed on the device and read back with the routing
    (``out``: target -> (logits, index) on the host); another target is computed on first request and read
    back on its own (a second, counted synchronisation)."""

    __slots__ = ("routers", "hidden", "out", "rows")

    def __init__(self, routers, hidden: torch.Tensor, out: Optional[dict], rows=None):
        """``routers``: each MoE layer's router call (``Adapter.router_call``: hooks bypassed); ``rows``: the
        call's live rows (host long), or None: every row is live."""
        self.routers = routers
        self.hidden = hidden
        self.out = out
        self.rows = rows

    @torch.no_grad()
    def __call__(self, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, E], the router's own top-k index [T, k]) of MoE layer ``target`` on this input, on the
        host."""
        got = self.out.get(target) if self.out is not None else None
        if got is None:
            logits, _, index = self.routers[target](self.hidden)
            got = (to_host(logits), to_host(index))
            if self.rows is not None:
                got = (got[0][self.rows], got[1][self.rows])
            if self.out is None:
                self.out = {}
            self.out[target] = got
        return got


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor read on the host outside the layer call's read-back (a copy even on a CPU device)."""
    return t.to("cpu", copy=True)


class HookRecord(LiveRecord):
    """A live layer call: the router's output on the host (read back once) and on the device (``device_index``,
    ``device_weights``: what the block passes to its experts; ``block_index``: None, or the selection the
    block passed instead, read on the host). Logits the stack did not read back are read on first use
    (``_late``: the device tensor).

    In a batch with pad or finished rows the record holds the live rows only (what the engine and the
    policies see); ``live`` is their row numbers in the block's ``[T, k]`` tensors (host long, ascending), and
    ``full_index``/``full_weights`` the block's whole selection on the host (pad rows: the router's own; live
    rows: what runs). ``live`` is None when every row is live (then the record's tensors are the block's)."""

    __slots__ = ("device_index", "device_weights", "block_index", "_late", "live", "full_index", "full_weights")

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None and self._late is not None:
            late, self._late = to_host(self._late), None
            self._logits = late if self.live is None else late[self.live]
        return LiveRecord.logits.fget(self)


class PolicyStack:
    """A policy stack installed in a model: the engine plus the hooks that feed it."""

    def __init__(self, model, spec: StackSpec, adapter: Optional[Adapter] = None, device=None,
                 checkpoint: Optional[str] = None):
        """``device``: where the model runs (default: where its first real parameter is); ``checkpoint``: the
        local checkpoint directory the model was loaded from (``execution.host=disk`` reads experts there)."""
        self.model = model
        adopt(model)  # a block outside transformers' MoE contract, put into it (Llama-4's: specmd.models.contract)
        self.adapter = adapter = adapter or adapter_for(model.config.model_type)
        self.spec = spec
        self.geom = adapter.geometry(model)
        self.moe_ids = list(self.geom.layer_ids)
        self.routers = [adapter.router(model, i) for i in self.moe_ids]
        self.tokens = TokenIds()  # the pass's token ids, which a hash-routed router reads (DeepSeek-V4)
        self.calls = [adapter.router_call(model, i, self.tokens) for i in self.moe_ids]  # each router as its block
        self.scoring = adapter.scoring(model.config, [adapter.bias_holder(model, i) for i in self.moe_ids],  # calls it
                                       adapter.hashed(model))
        self.expert_modules = [adapter.experts(model, i) for i in self.moe_ids]
        self.device = torch.device(device) if device is not None else next(
            p.device for p in model.parameters() if not p.is_meta)
        self.checkpoint = checkpoint
        from ..executor.kernel import expert_tensors

        E = adapter.num_experts(model.config)  # (an expert: the module's [E, ...] tensors; a shared norm is dense)
        expert_bytes = sum(p.numel() * p.element_size() for m in self.expert_modules
                           for p in expert_tensors(m, E).values())
        self.dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_bytes
        if spec.quant is None:
            from ..quant.none import NoQuant

            quant = NoQuant()
        else:
            qcls, qparams = spec.quant
            quant = qcls(qparams)
        config = model.config
        tag = f"{getattr(config, '_name_or_path', '')}|{type(model).__name__}|{next(model.parameters()).dtype}"
        self.store = quant.build([adapter.experts(model, i) for i in self.moe_ids], self.geom.num_experts, tag)
        self.engine = Engine(self.geom, spec, self.store)
        self.cache = self.engine.cache
        from ..executor.base import default_execution

        ecls, eparams = spec.execution or default_execution()
        self.executor = ecls(eparams)
        self.executor.attach(self)
        self.records: list[Optional[LiveRecord]] = [None] * self.geom.num_layers
        from .readback import Readback

        self.readback = Readback(self.device, self.geom.num_layers)
        # what every layer call reads back: the logits when a policy of the stack reads them (Policy.reads_logits)
        self.read_logits = any(getattr(spec, g)[0].reads_logits for g in GROUPS)
        self._writer = None
        from .live import LiveTokens

        self.live = LiveTokens()  # which positions of a pass are requests (a batch's pads and finished rows are not)
        self._rows = None  # this pass's live rows (host long), or None: every row is live
        self._idle = False  # this pass has no live position: no pass for the engine
        self._set_targets()
        self._handles = []
        self._originals = []

    @property
    def writer(self):
        """A :class:`specmd.replay.trace.TraceWriter` recording every pass and layer call, or None."""
        return self._writer

    @writer.setter
    def writer(self, writer) -> None:
        self._writer = writer
        self._set_targets()

    def _set_targets(self) -> None:
        """Per MoE layer, the later layers whose prefetch signal its calls read back: as far as the prefetch
        policy looks (when it predicts at all) and the trace writer records."""
        depth = 0 if self.engine.prefetch.passive() else self.spec.prefetch[0].signal_depth(self.spec.prefetch[1])
        writer = self._writer
        if writer is not None:
            depth = max(depth, writer.depth)
            self.read_logits = self.read_logits or writer.logit_dtype is not None
        L = self.geom.num_layers
        self.targets = [list(range(l + 1, min(l + depth, L - 1) + 1)) for l in range(L)]

    # ---- install / remove ---------------------------------------------------------------------------
    def install(self) -> "PolicyStack":
        adapter, model = self.adapter, self.model
        for ordinal, i in enumerate(self.moe_ids):
            experts = adapter.experts(model, i)
            self._originals.append((i, experts))
            adapter.set_experts(model, i, SpecmdExperts(experts, ordinal, self))
            self._handles.append(self.routers[ordinal].register_forward_hook(self._router_hook(ordinal), prepend=True))
        decoder = adapter.decoder(model)
        self._handles.append(decoder.register_forward_pre_hook(self._pass_start, with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._pass_end))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for i, experts in self._originals:
            self.adapter.set_experts(self.model, i, experts)
        self._handles, self._originals = [], []
        self.executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    # ---- forward passes -------------------------------------------------------------------------------
    def _pass_start(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens.ids = None if ids is None else ids.reshape(-1)  # [B * S]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        batch, seq = int(ids.shape[0]), int(ids.shape[1])
        past = kwargs.get("past_key_values")
        past_len = int(past.get_seq_length()) if past is not None else 0
        kind = "decode" if past_len > 0 else "prefill"
        live = self.live.begin(batch, seq, past_len, kwargs.get("attention_mask"))
        self._rows = live.rows
        self._idle = live.tokens == 0
        if self._idle:  # every sequence of the batch has finished: nothing here is a request
            return
        self.executor.begin_pass(kind, live.tokens)
        self.engine.begin_pass(kind, live.tokens, live.context, live.contexts)
        if self.writer is not None:
            self.writer.begin_pass(kind, live.tokens, live.context)

    def _pass_end(self, module, args, output):
        if self._idle:
            self._idle = False
            return
        self.engine.end_pass()
        self.executor.end_pass()
        if self.writer is not None:
            self.writer.end_pass()

    def _router_hook(self, layer: int):
        records, engine, scoring, routers = self.records, self.engine, self.scoring, self.calls
        readback, device = self.readback, self.device

        def hook(module, args, output):
            if self._idle:
                return None
            logits, weights, index = output
            hidden = args[0]
            hidden = hidden.reshape(-1, hidden.shape[-1])
            read_logits = self.read_logits
            want = [index, weights, logits] if read_logits else [index, weights]
            targets = self.targets[layer]
            for t in targets:  # the later routers on this input (hooks bypassed), read back with the routing
                t_logits, _, t_index = routers[t](hidden)
                want += (t_logits, t_index)
            host = readback(layer, want)  # the layer call's one synchronisation
            n = len(want) - 2 * len(targets)
            rows = self._rows
            if rows is not None:  # a batch with pad or finished rows: the engine sees the live rows only
                full = host
                host = [h[rows] for h in host]
            signal = {t: (host[n + 2 * i], host[n + 2 * i + 1]) for i, t in enumerate(targets)} if targets else None
            rec = HookRecord(layer, host[2] if read_logits else None, host[1], host[0], scoring,
                             LiveSignal(routers, hidden, signal, rows))
            rec._late = None if read_logits else logits
            rec.device_index, rec.device_weights, rec.block_index = index, weights, None
            rec.live = rows
            if rows is not None:
                rec.full_index, rec.full_weights = full[0], full[1]
            records[layer] = rec
            if engine.route(rec):  # the routing policy's selection (on the host) goes to the block's experts
                sel, w = rec.index, rec.weights
                if rows is not None:  # pad rows keep the router's own selection
                    sel, w = rec.full_index.clone(), rec.full_weights.clone()
                    sel[rows], w[rows] = rec.index, rec.weights
                    rec.full_index, rec.full_weights = sel, w
                rec.device_index = upload(sel, device)
                rec.device_weights = upload(w, device)
                return logits, rec.device_weights, rec.device_index
            return None

        return hook

    # ---- one MoE layer call ------------------------------------------------------------------------------
    def run_layer(self, mod: SpecmdExperts, hidden, index, weights):
        if self._idle:  # no live position: no request, no engine (what the executor computes there is its own)
            return self.executor.run_idle(mod, hidden, index, weights)
        rec = self.records[mod.layer]
        if self._writer is not None:
            self._writer.layer(rec)
        if index is rec.device_index and weights is rec.device_weights:
            plan = self.engine.layer(rec)  # the block passes what the router hook returned (every family does)
        else:  # it changed them: the engine and executor serve what it passes (read back: a second synchronisation)
            block_index, block_weights = to_host(index), to_host(weights)
            rows = rec.live
            if rows is not None:
                rec.full_index, rec.full_weights = block_index, block_weights
                block_index, block_weights = block_index[rows], block_weights[rows]
            rec.block_index = block_index
            plan = self.engine.layer(rec, block_index, block_weights)
        return self.executor.run(mod, hidden, index, weights, plan, rec)


def install(model, spec: StackSpec, adapter: Optional[Adapter] = None, device=None,
            checkpoint: Optional[str] = None) -> PolicyStack:
    """Install the policy stack ``spec`` into ``model``; ``stack.remove()`` (or ``with``) restores it."""
    return PolicyStack(model, spec, adapter, device, checkpoint).install()
