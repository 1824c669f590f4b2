"""MoE blocks outside transformers' MoE contract, put into it.

transformers 5's contract (what the hook, the probe and the kernels speak): the block calls its router as
``router(hidden [T, H]) -> (logits [T, E], weights [T, k], index [T, k])`` and its fused experts as
``experts(hidden [T, H], index, weights) -> [T, H]`` with the flags ``use_experts_implementation`` sets
(``has_gate``, ``is_transposed``, ``_apply_gate``). A block of another shape is *adopted*: the ``forward``
of its instances (block, router, experts) is rebound to the same arithmetic spoken in the contract --
its parameters, their names, its state dict and its hub layout unchanged -- so a checkpoint loads as
before and the model computes the same function (each conversion says where it changes bits, and why). The
conversions are keyed by the block's class name: :data:`CONTRACTS`.

The rebound forwards are ``functools.partial`` of module-level functions, so an adopted model pickles and
unpickles (a bound method would not unpickle: it is found again by its function's name). Adoption is idempotent
and permanent; :func:`adopt` is called wherever a model is probed, loaded or hooked
(``tiny.build``, the loader, ``PolicyStack``), so the unhooked model a run compares with is the adopted one.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F


def _llama4(block) -> None:
    """Llama-4's ``Llama4TextMoe`` (transformers' ``models/llama4/modeling_llama4.py``): its router returns
    ``(scores [T, E], logits)`` -- ``sigmoid`` of the top-k logits, 0 elsewhere -- and each selected expert runs
    on its input scaled by that score (an **input-weighted** expert: ``expert_e(x * s_e)``, not
    ``s_e * expert_e(x)``), the outputs added up. In the contract the router returns the top-k ``(logits,
    sigmoid(top logits), index)`` (the same numbers) and the experts run the selected experts alone
    (``ExpertsLayout.input_weighted``).

    That is the one place adoption changes bits, argued: transformers' block runs **every** expert on every
    token (zeros in, zeros out: ``act(0) * 0 = 0``) and sums the ``[E, T, H]`` outputs -- its own docstring
    says it "should really not be run on a single machine" -- which reads all E experts' weights at every
    layer call, the traffic an expert cache exists to avoid. The serving engines run it sparsely (vLLM's
    ``FusedMoE`` with ``apply_router_weight_on_input=True`` for Llama-4); so does specmd. The functions are
    equal; the bits are not, because a GEMM's rows round by its row count on the CPU (an expert's 48 token rows
    in one ``mm`` and the same rows among T other zero rows: 2.3e-9 apart at most on the probe's tiny
    instance, fp32). The adopted model is the reference everything is compared with (hooked == unhooked,
    offloaded == simulated, bit for bit), and ``tests/models/test_derived.py`` bounds its distance from the dense
    block."""
    router, experts = block.router, block.experts
    router.forward = partial(_llama4_router, router)
    experts.forward = partial(_input_weighted_experts, experts)
    experts._apply_gate = partial(_chunk_gate, experts)
    experts.has_gate, experts.is_transposed = True, True  # gate_up_proj [E, H, 2I] (gate columns first), down [E, I, H]
    from ..executor.kernel import Bank
    from .family import ExpertsLayout

    E = experts.gate_up_proj.shape[0]
    experts._specmd_layout = ExpertsLayout(gated=True, transposed=True, input_weighted=True)
    experts._specmd_banks = [Bank({"gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}, 0, E)]
    experts.register_buffer("_specmd_map", torch.arange(E, device=experts.gate_up_proj.device), persistent=False)
    block.forward = partial(_llama4_block, block)


def _llama4_router(self, hidden_states):
    # hidden_states [T, H]; self: the router (an nn.Linear [E, H])
    logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
    top, index = torch.topk(logits, self.top_k, dim=1)  # [T, k]
    scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)  # [T, E] as its router builds them:
    scores = torch.sigmoid(scores.float()).to(logits.dtype)  # (a sigmoid over [T, k] alone rounds 1 ulp otherwise)
    return logits, scores.gather(1, index), index  # weights [T, k]


def _input_weighted_experts(self, hidden_states, top_k_index, top_k_weights):
    """Input-weighted fused experts, sparsely: specmd's grouped experts kernel over the module's own weights (rows
    scaled first, one grouped GEMM per projection, added in ascending id in float32: ``input_weighted``) --
    what the offload executor runs, with no host synchronisation (a loop over the selected experts took 7 per
    layer call: ``benchmarks/counting.py``)."""
    from ..executor.kernel import grouped_experts

    # hidden_states [T, H]; top_k_index / top_k_weights [T, k]; gate_up_proj [E, H, 2I], down_proj [E, I, H]
    return grouped_experts(self, self._specmd_layout, hidden_states, top_k_index, top_k_weights, self._specmd_map,
                           self._specmd_banks)  # [T, H]


def _llama4_block(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # [T, H]
    router_logits, weights, index = self.router(hidden_states)
    out = self.shared_expert(hidden_states)  # [T, H]
    out.add_(self.experts(hidden_states, index, weights))
    return out, router_logits


def _chunk_gate(self, gate_up):
    # gate_up [n, 2I] -> [n, I]: the first half gated by the activation (Llama4TextExperts.forward)
    gate, up = gate_up.chunk(2, dim=-1)
    return up * self.act_fn(gate)


def _identity_rows(experts) -> None:
    """LongCat-Flash's ``LongcatFlashExperts``: its ``gate_up_proj`` is allocated ``[E + Z, 2I, H]`` for its Z
    identity ("zero-computation") experts too, whose rows its forward never reads (an identity expert returns
    its input); ``down_proj`` is ``[E, H, I]``. Declared (``identity_rows``) so that an expert is its first E
    rows (:func:`specmd.executor.kernel.expert_tensors`), and its gate (``act(gate) * up`` of the projection's halves)
    named as the kernels call it; its forward is the contract's."""
    if experts.gate_up_proj is not None and experts.gate_up_proj.shape[0] > experts.down_proj.shape[0]:
        experts.identity_rows = experts.gate_up_proj.shape[0] - experts.down_proj.shape[0]
    experts._apply_gate = partial(_chunk_gate, experts)  # (its forward's gate, which the kernels call)


# a block's (or experts module's) class name -> how its instances are put into the contract
CONTRACTS = {"Llama4TextMoe": _llama4, "LongcatFlashExperts": _identity_rows}


def adopt(model) -> None:
    """Put every MoE block of ``model`` whose class :data:`CONTRACTS` names into the contract (once)."""
    for module in model.modules():
        convert = CONTRACTS.get(type(module).__name__)
        if convert is not None and not getattr(module, "_specmd_contract", False):
            convert(module)
            module._specmd_contract = True


# ---- what transformers' random initialisation leaves degenerate ----------------------------------------------
def _hash_table(router, generator) -> None:
    """DeepSeek-V4's ``DeepseekV4HashRouter.tid2eid`` [V, k]: transformers initialises it to zeros ("real values
    come from the checkpoint"), every token then routed k times to expert 0; a random model gets each token k
    distinct experts, drawn uniformly, as a trained table has them."""
    V, k = router.tid2eid.shape
    E = router.num_experts
    with torch.no_grad():
        router.tid2eid.copy_(torch.rand(V, E, generator=generator).argsort(dim=-1)[:, :k])


RANDOM_INIT = {"DeepseekV4HashRouter": _hash_table}  # a module's class name -> how a random model fills it


def random_fill(model, seed: int = 0) -> None:
    """Fill what transformers' initialisation leaves degenerate in a random model (:data:`RANDOM_INIT`), seeded;
    never called on a loaded checkpoint."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        fill = RANDOM_INIT.get(type(module).__name__)
        if fill is not None:
            fill(module, generator)
