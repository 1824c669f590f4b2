"""The experts kernels that run a layer call's experts from wherever the executor keeps their weights.

:func:`grouped_experts` (``execution=offload``): the experts are *banks* of fused ``[n, ...]`` tensors -- the
pool's arena (:class:`~.arena.SlotArena`), a staging area of streamed or unpacked copies, the host tier --
and the layer call's expert map sends each expert id to a slot id (vLLM's ``expert_map``). Each bank runs as
**one grouped GEMM per projection** through transformers' own ``_grouped_linear`` (the ``grouped_mm``
experts forward of ``integrations/moe.py``, the default of every fused experts module specmd hooks): no
Python loop over experts, no launch per expert, and no data-dependent shape from the device (the row counts
it slices by, when it needs any, come from the routing the host already read).

Why it keeps the bits of the stock kernel (``tests/executor/test_offload.py`` checks it on every family): grouped_mm
computes each group's rows independently of where they sit in the batch (measured on the CPU: the same rows
in the same order give the same bits at any offset, for fp32 and bf16), but a GEMM's rows do depend on
their order *within* the group. Sorting by slot id alone reorders them (the stock sort is unstable): 107 of
200 random fp32 layer calls then differed in the last bits (up to 3e-5). So the rows are first sorted by
expert id exactly as the stock kernel sorts them (same unstable sort, same permutation), then *stably* by
slot id: groups move to slot order, each group's rows keep the stock order -- 0 of 300 differ. Elementwise
steps (gate, weighting, the top-k sum) run over the whole batch as in the stock kernel.

:func:`run_experts` (``execution=simulated`` with stored low-precision copies, and the reference the grouped
kernel is tested against): the same arithmetic group by group with per-expert weight views, one
``torch.mm`` per group as CPU ``grouped_mm`` runs them.
"""

from __future__ import annotations

from bisect import bisect_left
from concurrent.futures import wait as futures_wait
from typing import Callable, Optional, Sequence

import torch

from ..signals import SIGNALS


class Bank:
    """Experts as fused tensors ``tensors[name]`` ``[n, ...]`` (the family's layout), holding the global slot
    ids ``first .. first + n - 1`` of a layer call's expert map."""

    __slots__ = ("tensors", "first", "n", "tickets", "lo", "hi", "runner")

    def __init__(self, tensors: dict, first: int, n: int, runner=None):
        self.tensors = tensors
        self.first = first
        self.n = n
        # who computes this bank's rows instead of the caller (the host tier's bank, :mod:`.hostwork`: a worker
        # thread beside the device, or inline first in the call), or None
        self.runner = runner
        self.tickets: list = []  # what the bank waits for (the executor's transfers; ``ready``)
        # the slots this call reads, [lo, hi) within [first, first + n): a grouped GEMM spans only them (an empty
        # group still costs ~1 us on a CPU: a 1,024-slot arena made offload 3.8x slower than simulated)
        self.lo, self.hi = first, first + n


def grouped_experts(mod, layout, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                    slot_of: torch.Tensor, banks: Sequence[Bank], rows: Optional[Sequence[int]] = None,
                    ready: Optional[Callable] = None, groups: Optional[Sequence] = None,
                    identity_from: Optional[int] = None) -> torch.Tensor:
    """The layer call's experts from ``banks``. ``mod``: the family's fused experts module (its gate and
    activation; its own weights are not read); ``layout``: its adapter's
    :class:`~specmd.models.adapters.ExpertsLayout`; ``hidden`` [T, H]; ``index``/``weights`` [T, k]
    on the device; ``slot_of`` [E] long on the device: each expert's global slot this call, or the sentinel
    ``banks[-1].first + banks[-1].n``: it does not run here and its rows contribute zero (its weight is zero:
    dropped; or its output is not this kernel's). ``rows``: with several banks or sentinel rows, the
    token-expert rows of each bank in order (host ints, from the routing the host read); None: one bank, no
    sentinel. ``ready(bank)``: called just before a bank's weights are read, so a bank computes while the
    copies into the next are still landing (each bank's rows run up, gate and down before the next bank's:
    the gate is elementwise, and on row slices it gives the whole batch's bits -- 320 of 320 random splits,
    every family). ``groups``: per bank with rows, ``(end rows, slots)`` of its groups in slot order (host ints,
    rows counted from the bank's first row, slots within the bank): each projection then runs one ``torch.mm``
    per group (the *looped* variant, :func:`_grouped`: what CPU ``grouped_mm`` computes per group, same bits)
    instead of one grouped call -- on a CPU, where a launch costs nothing and an empty group of the grouped
    call ~1 us, it is the faster (on deep_olmoe at capacity 1.0 the grouped call was 3.8x simulated over the
    whole 1,024-slot arena, 1.9x spanning only the slots read; looped 1.01-1.05x); ``rows`` is then
    required. ``identity_from``: ids from it on are identity experts' (LongCat-Flash's zero-computation experts:
    their output is their input; ``slot_of`` maps them to the sentinel, ``rows`` leave them out), or None: none.
    Returns [T, H]."""
    k = index.size(-1)
    T, H = hidden.shape
    S = T * k
    total = banks[-1].first + banks[-1].n  # slot ids 0..total-1; total: the sentinel
    expert_ids = index.reshape(-1)  # [S]
    perm = _rows(expert_ids, k, layout)  # [S] the rows grouped by expert, in the module's order
    slots_g, order = torch.sort(slot_of[expert_ids[perm]], stable=True)  # [S] groups in slot order, rows kept
    perm = perm[order]  # [S]
    x_g = hidden[perm // k]  # [S, H]
    w_g = weights.reshape(-1)[perm]  # [S]
    if layout.input_weighted:  # each expert's input scaled by its weight (Llama-4)
        x_g = x_g * w_g.to(x_g.dtype).unsqueeze(-1)  # [S, H]
    if groups is None:
        offs = group_ends(slots_g, total)  # [total] end row of each slot's group
        parts = _parts(offs, banks, rows)  # [(bank, first row, rows, its group ends)]
    else:  # the looped variant: the groups, from the host
        parts = _looped_parts(banks, rows, groups)  # [(bank, first row, rows, its (end rows, slots))]
    outs = _run_parts(mod, layout, parts, x_g, slots_g, ready)  # [n, H] per part
    done = parts[-1][1] + parts[-1][2] if parts and parts[-1][2] >= 0 else (S if parts else 0)
    if done < S:  # sentinel rows: nothing runs here, their contribution is zero
        outs.append(hidden.new_zeros(S - done, H, dtype=outs[0].dtype if outs else hidden.dtype))
    proj = outs[0] if len(outs) == 1 else torch.cat(outs)  # [S, H]
    if layout.post_norm:
        proj = mod.post_expert_norm(proj)
    if identity_from is not None:  # an identity expert's rows: its input
        proj = torch.where((expert_ids[perm] >= identity_from).unsqueeze(-1), x_g.to(proj.dtype), proj)  # [S, H]
    weighted = proj if layout.input_weighted else proj * w_g.unsqueeze(-1)  # [S, H]
    return _combine(weighted, perm, expert_ids, hidden, k, layout)  # [T, H]


def _looped_parts(banks: Sequence[Bank], rows: Sequence[int], groups: Sequence) -> list:
    """:func:`_parts` of the looped variant: each bank that has rows this call, with its groups from the host."""
    parts, r0 = [], 0
    for b, n in zip(banks, rows):
        if n:
            parts.append((b, r0, n, groups[len(parts)]))
            r0 += n
    return parts


def _run_parts(mod, layout, parts: list, x_g: torch.Tensor, slots_g: torch.Tensor, ready: Optional[Callable]) -> list:
    """Each part's rows (``x_g`` [S, H], sorted by slot ``slots_g`` [S]) through its bank: ``[n, H]`` per part,
    in order. A bank another runner computes (the host tier's) is started first, beside the rest; each other
    bank is ``ready`` just before its weights are read."""
    names = layout.names
    transposed, gated, up_b = layout.transposed, layout.gated, names[2]
    rows_of = [(x_g if n < 0 else x_g[r0:r0 + n],  # [n, H] each bank's rows, and their slots [n] (biases only)
                None if up_b is None else slots_g if n < 0 else slots_g[r0:r0 + n]) for _, r0, n, _ in parts]
    outs: list = [None] * len(parts)
    remote = [j for j, p in enumerate(parts) if p[0].runner is not None]  # banks another runner computes
    try:
        for j in remote:  # started first, beside the rest
            b, (x, sl) = parts[j][0], rows_of[j]
            outs[j] = b.runner.submit(bank_where_it_is, mod, x, sl, b, parts[j][3], names, transposed, gated)
        for j, (b, _, _, ends) in enumerate(parts):
            if outs[j] is not None:
                continue
            if ready is not None:
                ready(b)
            x, sl = rows_of[j]
            outs[j] = _bank(mod, x, sl, b, ends, names, transposed, gated)  # [n, H]
    finally:  # the host's rows are waited for before an error leaves the call too: a worker never computes
        # from a bank the next call re-points. Only what was submitted (a signal can land between two submits),
        # and with signals held: a second Ctrl-C must not tear the wait down under the worker
        if remote:
            _join([outs[j] for j in remote if outs[j] is not None])
    for j in remote:
        outs[j] = outs[j].result()  # [n, H] the host's rows, joined before the top-k sum (raises the worker's error)
    return outs


def _join(futures: list) -> None:
    """Wait for the host's ``futures``; a signal meanwhile is recorded (:mod:`specmd.signals`) and raised at the
    next safe point, never inside the wait."""
    held, SIGNALS.held = SIGNALS.held, True
    try:
        futures_wait(futures)
    finally:
        SIGNALS.held = held


def _bank(mod, x: torch.Tensor, sl: Optional[torch.Tensor], b: Bank, ends, names: tuple, transposed: bool,
          gated: bool) -> torch.Tensor:
    """One bank's rows ``x`` [n, H] through up, gate and down: [n, H]."""
    up, down, up_b, down_b = names
    h = _linear(x, sl, b, ends, up, up_b, transposed)  # [n, 2I] (or [n, I] ungated)
    h = mod._apply_gate(h) if gated else mod.act_fn(h)  # [n, I]
    return _linear(h, sl, b, ends, down, down_b, transposed)  # [n, H]


def bank_where_it_is(mod, x: torch.Tensor, sl: Optional[torch.Tensor], b: Bank, ends, names: tuple,
                     transposed: bool, gated: bool) -> torch.Tensor:
    """:func:`_bank` where the bank's weights are (the host tier, on the worker's thread): the rows go there and
    the result comes back to ``x``'s device."""
    where = next(iter(b.tensors.values())).device
    if where == x.device:
        return _bank(mod, x, sl, b, ends, names, transposed, gated)
    moved = ends if isinstance(ends, tuple) else ends.to(where)  # (the looped variant's groups are host ints)
    out = _bank(mod, x.to(where), None if sl is None else sl.to(where), b, moved, names, transposed, gated)
    return out.to(x.device)


def group_ends(slots_g: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int32: the end row of each slot's group in ``slots_g`` (sorted slot ids; ``total``: the
    sentinel, not counted), as transformers' experts forward computes them (histc, then cumsum)."""
    ids = slots_g.float() if slots_g.device.type in ("cpu", "mps") else slots_g.int()  # (histc's dtypes)
    if total > 1:
        counts = torch.histc(ids, bins=total, min=0, max=total - 1)  # the sentinel, above max: out
    else:  # (histc with min == max takes the data's own range: the sentinel would count)
        counts = torch.histc(ids, bins=2, min=0, max=1)[:1]
    return torch.cumsum(counts, 0, dtype=torch.int32)


def _parts(offs: torch.Tensor, banks: Sequence[Bank], rows: Optional[Sequence[int]]) -> list:
    """Each bank that has rows this call: (bank, its first row, its rows, its groups' end rows counted from
    its first row [n_b]); ``rows`` None: the one bank has them all."""
    if rows is None:
        b = banks[0]
        return [(b, 0, -1, offs if (b.lo, b.hi) == (0, len(offs)) else offs[b.lo:b.hi])]
    out, r0 = [], 0
    for b, n in zip(banks, rows):
        if n:
            ends = offs[b.lo:b.hi]  # [hi - lo] the group ends of the slots it reads, from row 0 of the whole call
            out.append((b, r0, n, ends - r0 if r0 else ends))
            r0 += n
    return out


def _linear(x: torch.Tensor, slots: torch.Tensor, b: Bank, ends: torch.Tensor, name: str, bias: Optional[str],
            transposed: bool) -> torch.Tensor:
    """One projection of one bank's rows: transformers' grouped linear over the bank's weights of slots
    ``[lo, hi)`` (``[hi - lo, ...]``), or (``ends`` the host's ``(end rows, slots)``) one ``torch.mm`` per group."""
    from transformers.integrations.moe import _grouped_linear

    if isinstance(ends, tuple):
        W = b.tensors[name]  # [n_b, out, in] ([n_b, in, out] transposed)
        bounds, slots_b = ends
        return _grouped(x, bounds, slots_b, W, b.tensors[bias] if bias else None, transposed,
                        W.shape[-1] if transposed else W.shape[-2], False)  # [n, out]

    lo, hi = b.lo - b.first, b.hi - b.first
    w = b.tensors[name]
    if lo or hi != b.n:
        w = w[lo:hi]
    return _grouped_linear(x, w, ends, b.tensors[bias][slots - b.first if b.first else slots] if bias else None,
                           transposed)


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


def run_experts(mod, layout, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                sources: dict) -> torch.Tensor:
    """``mod``: the family's fused experts module (its gate and activation); ``layout``: its adapter's
    :class:`~specmd.models.adapters.ExpertsLayout`; ``hidden`` [T, H];
    ``index``/``weights`` [T, k]; ``sources[name][e]``: expert ``e``'s tensor of parameter ``name`` (a view,
    [2I, H] / [H, I], transposed for GPT-OSS; biases [2I] / [H]), or None: the expert does not run here and
    its rows contribute zero (a dropped expert's weight is zero anyway). An id past the sources is an identity
    expert's (LongCat-Flash's): its output is its input. Returns [T, H]."""
    up, down, up_b, down_b = layout.names
    Wu, Wd = sources[up], sources[down]
    Bu = sources[up_b] if up_b else None
    Bd = sources[down_b] if down_b else None
    transposed = layout.transposed
    k = index.size(-1)
    T, H = hidden.shape
    sample_weights = weights.reshape(-1)  # [S]
    expert_ids = index.reshape(-1)  # [S]
    perm = _rows(expert_ids, k, layout)  # [S] the rows grouped by expert, in the module's order
    expert_ids_g = expert_ids[perm]
    x_g = hidden[perm // k]  # [S, H]
    w_g = sample_weights[perm]  # [S]
    if layout.input_weighted:  # each expert's input scaled by its weight (Llama-4)
        x_g = x_g * w_g.to(x_g.dtype).unsqueeze(-1)  # [S, H]
    counts = torch.bincount(expert_ids_g)
    experts = counts.nonzero().squeeze(1).tolist()
    bounds = torch.cumsum(counts, 0)[experts].tolist()
    n_real = bisect_left(experts, len(Wu))  # experts with weights; identity experts' rows come last (sorted ids)
    experts, rows = experts[:n_real], bounds[n_real - 1] if n_real else 0
    bounds = bounds[:n_real]
    skip = any(Wu[e] is None for e in experts)
    w0 = next(Wu[e] for e in experts if Wu[e] is not None) if not all(Wu[e] is None for e in experts) else None
    if w0 is None and rows == x_g.shape[0]:  # nothing runs here
        return torch.zeros_like(hidden)
    if w0 is None:  # identity experts' rows alone run here: the others contribute zero
        proj = x_g.new_zeros(rows, x_g.shape[1])
    else:
        up_dim = w0.shape[-1] if transposed else w0.shape[0]
        proj = _grouped(x_g if rows == x_g.shape[0] else x_g[:rows], bounds, experts, Wu, Bu, transposed, up_dim,
                        skip)  # [rows, 2I]
        proj = mod._apply_gate(proj) if layout.gated else mod.act_fn(proj)  # [rows, I]
        wd0 = next(Wd[e] for e in experts if Wd[e] is not None)
        down_dim = wd0.shape[-1] if transposed else wd0.shape[0]
        proj = _grouped(proj, bounds, experts, Wd, Bd, transposed, down_dim, skip)  # [rows, H]
        if layout.post_norm:
            proj = mod.post_expert_norm(proj)
    if rows < x_g.shape[0]:  # identity experts' rows: their input
        proj = torch.cat([proj, x_g[rows:].to(proj.dtype)])  # [S, H]
    weighted = proj if layout.input_weighted else proj * w_g.unsqueeze(-1)  # [S, H]
    return _combine(weighted, perm, expert_ids, hidden, k, layout)  # [T, H]


def _rows(expert_ids: torch.Tensor, k: int, layout) -> torch.Tensor:
    """``[S]``: the flat ``[T * k]`` selection's rows grouped by expert, in the order the family's module runs
    them (a matmul's rows can round by their position): transformers' fused kernels take the stock (unstable)
    sort's order; a module with its own loop (``own_loop``) takes ``torch.where(one_hot(index)[e])``'s, by rank
    then token; input-weighted experts (Llama-4's, every token through every expert) take token order."""
    if layout.input_weighted:
        return torch.sort(expert_ids, stable=True)[1]  # (expert, token): a token holds an expert once
    if not layout.own_loop:
        return torch.sort(expert_ids)[1]
    S = expert_ids.numel()
    pos = torch.arange(S, device=expert_ids.device)
    return torch.argsort(expert_ids * S + (pos % k) * (S // k) + pos // k)  # (expert, rank, token): unique keys


def _combine(weighted: torch.Tensor, perm: torch.Tensor, expert_ids: torch.Tensor, hidden: torch.Tensor, k: int,
             layout) -> torch.Tensor:
    """``[T, H]``: each token's weighted expert outputs (``weighted`` [S, H], row ``i`` the slot ``perm[i]`` of
    the flat ``[T * k]`` selection ``expert_ids``) added up as the family's experts module does: transformers'
    fused experts sum a token's k slots in rank order (``view(T, k, H).sum(1)``); a module with its own loop
    (``own_loop``: Step-3.7's, MuSe-Spark's) adds each expert's outputs onto zeros in ascending expert id, in
    the hidden states' dtype (``index_add_`` per expert; here k column adds, in order: deterministic on every
    device, where one ``index_add_`` with repeated rows is not on CUDA); input-weighted experts (Llama-4's
    ``[E, T, H].sum(0)``, the others' rows exactly 0) add in ascending id in float32, rounded once (torch's sum
    accumulates a bf16 tensor in float). (That sum adds its E rows in sequence where E <= 16 -- every shape
    measured, fp32 and bf16 -- and in a cascade beyond, which k > 1 then rounds otherwise in the last fp32 bit:
    Llama-4's checkpoints route top-1, where one row is added.)"""
    T, H = hidden.shape
    inv = torch.empty_like(perm)  # [S]
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    rows = weighted[inv].view(T, k, H)  # [T, k, H] (token, rank) order
    if not (layout.own_loop or layout.input_weighted):
        return rows.sum(dim=1).to(hidden.dtype)  # [T, H]
    order = expert_ids.view(T, k).argsort(dim=1)  # [T, k] each token's ranks by ascending expert id (distinct)
    acc = torch.float32 if layout.input_weighted else hidden.dtype
    rows = rows.gather(1, order.unsqueeze(-1).expand(T, k, H)).to(acc)
    out = torch.zeros(T, H, dtype=acc, device=hidden.device)
    for j in range(k):
        out = out + rows[:, j]
    return out.to(hidden.dtype)


def expert_tensors(mod, num_experts: int) -> dict[str, torch.Tensor]:
    """The per-expert parameters of a fused experts module: every parameter with a leading E axis (weights
    [E, ...] and GPT-OSS's biases [E, out]); one allocated for the identity experts too (a leading axis of E +
    ``mod.identity_rows``, rows past E never read: LongCat-Flash's ``gate_up_proj``, :mod:`specmd.models.contract`)
    at its first E rows."""
    extra = num_experts + getattr(mod, "identity_rows", 0)
    return {n: p if p.shape[0] == num_experts else p[:num_experts] for n, p in mod.named_parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] in (num_experts, extra)}


def views_of(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, list]:
    """``sources`` for :func:`run_experts` over fused tensors: per name, the E per-expert views."""
    return {n: [t.detach()[e] for e in range(num_experts)] for n, t in tensors.items()}
