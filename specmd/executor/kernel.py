"""The experts kernel that runs from per-expert weight views (arena slots, staging, host tier, quantized
copies): the arithmetic of transformers' ``grouped_mm`` experts forward (``integrations/moe.py``), the
default implementation of every fused experts module specmd hooks, group by group.

Why not the stock kernel with remapped indices (vLLM's ``expert_map`` applied to ``top_k_index``)? Its
groups are sorted by index, so remapping an expert to another slot moves its rows within the sorted batch;
on the CPU the GEMM of a row then differs in the last bits (measured on the tiny OLMoE layer, T=17 tokens:
max |diff| 9e-10), and lossless offloaded runs must equal simulated ones bit for bit. This kernel sorts by
the *expert* id exactly as the stock kernel does (same permutation, same group boundaries, same
``torch.mm`` per group that CPU ``grouped_mm`` runs, same gate, same top-k sum), and only reads each
group's weights from wherever that expert's bytes are. ``tests/test_offload.py`` checks it equals the stock
kernel bit for bit on every family.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def weight_names(mod) -> tuple[str, str, Optional[str], Optional[str]]:
    """(up weight, down weight, up bias, down bias) parameter names of a fused experts module."""
    up = "gate_up_proj" if getattr(mod, "has_gate", True) else "up_proj"
    bias = getattr(mod, "has_bias", False)
    return up, "down_proj", (up + "_bias") if bias else None, ("down_proj_bias" if bias else None)


def _grouped(x_g: torch.Tensor, bounds: Sequence[int], experts: Sequence[int], W: Sequence, B: Optional[Sequence],
             transposed: bool, out_dim: int, skip: bool) -> torch.Tensor:
    # x_g [S, in] rows sorted by expert; W[e]: [out, in] (or [in, out] when transposed); B[e]: [out]
    out = (torch.zeros if skip else torch.empty)(x_g.shape[0], out_dim, dtype=W[experts[0]].dtype
                                                 if W[experts[0]] is not None else x_g.dtype, device=x_g.device)
    start = 0
    for e, end in zip(experts, bounds):
        w = W[e]
        if w is not None:
            xs = x_g[start:end].to(w.dtype)
            torch.mm(xs, w if transposed else w.t(), out=out[start:end])
            if B is not None:
                out[start:end].add_(B[e])
        start = end
    return out


def run_experts(mod, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, sources: dict) -> torch.Tensor:
    """``mod``: the family's fused experts module (its gate, activation, layout flags); ``hidden`` [T, H];
    ``index``/``weights`` [T, k]; ``sources[name][e]``: expert ``e``'s tensor of parameter ``name`` (a view,
    [2I, H] / [H, I], transposed for GPT-OSS; biases [2I] / [H]), or None: the expert does not run here and
    its rows contribute zero (a dropped expert's weight is zero anyway). Returns [T, H]."""
    up, down, up_b, down_b = weight_names(mod)
    Wu, Wd = sources[up], sources[down]
    Bu = sources[up_b] if up_b else None
    Bd = sources[down_b] if down_b else None
    transposed = bool(getattr(mod, "is_transposed", False))
    k = index.size(-1)
    T, H = hidden.shape
    sample_weights = weights.reshape(-1)  # [S]
    expert_ids = index.reshape(-1)  # [S]
    expert_ids_g, perm = torch.sort(expert_ids)  # the stock kernel's (unstable) sort: same permutation
    x_g = hidden[perm // k]  # [S, H]
    w_g = sample_weights[perm]  # [S]
    counts = torch.bincount(expert_ids_g)
    experts = counts.nonzero().squeeze(1).tolist()
    bounds = torch.cumsum(counts, 0)[experts].tolist()
    skip = any(Wu[e] is None for e in experts)
    w0 = next(Wu[e] for e in experts if Wu[e] is not None) if not all(Wu[e] is None for e in experts) else None
    if w0 is None:  # nothing runs here
        return torch.zeros_like(hidden)
    up_dim = w0.shape[-1] if transposed else w0.shape[0]
    proj = _grouped(x_g, bounds, experts, Wu, Bu, transposed, up_dim, skip)  # [S, 2I]
    proj = mod._apply_gate(proj) if getattr(mod, "has_gate", True) else mod.act_fn(proj)  # [S, I]
    wd0 = next(Wd[e] for e in experts if Wd[e] is not None)
    down_dim = wd0.shape[-1] if transposed else wd0.shape[0]
    proj = _grouped(proj, bounds, experts, Wd, Bd, transposed, down_dim, skip)  # [S, H]
    if getattr(mod, "has_post_expert_norm", False):
        proj = mod.post_expert_norm(proj)
    weighted = proj * w_g.unsqueeze(-1)  # [S, H]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted = weighted[inv]
    return weighted.view(T, k, H).sum(dim=1).to(hidden.dtype)  # [T, H]


def expert_tensors(mod, num_experts: int) -> dict[str, torch.Tensor]:
    """The per-expert parameters of a fused experts module: every parameter with a leading E axis (weights
    [E, ...] and GPT-OSS's biases [E, out])."""
    return {n: p for n, p in mod.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts}


def views_of(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, list]:
    """``sources`` for :func:`run_experts` over fused tensors: per name, the E per-expert views."""
    return {n: [t.detach()[e] for e in range(num_experts)] for n, t in tensors.items()}
