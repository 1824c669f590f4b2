"""Each layer call's layout around its experts: the "prepare / finalize" half of ``execution=offload`` (vLLM's
split of a fused-MoE call into prepare, experts, finalize; the experts half is :mod:`.kernel`).

:class:`Placement` extends the arena's occupancy (:class:`~.occupancy.ArenaOccupancy`, the engine's residency
carried out in the arena: slots, tickets, compaction, stream staging rows, copy jobs) with the layer call. Per call,
:meth:`~Placement.plan_call` puts what does not run from a slot into place (stored low-precision copies
unpacked, a mixed arena's native copies, host-computed experts off a CPU) in the *work* staging bank, and
returns the call's :class:`CallPlan`: the expert map (expert id -> global slot id, uploaded once) and the
banks :func:`~.kernel.grouped_experts` runs, each with the copies it waits for; :meth:`~Placement.ready`
acquires them just before that bank computes (a prefetch still queued is promoted: the simulated clock's
late prefetch); :meth:`~Placement.finalize` releases the call's staging rows.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..accel import accel_for, host_buffer
from .arena import Staging
from .host import register_host
from .kernel import Bank
from .occupancy import ArenaOccupancy, StagedCopy


SPAN_MIN_SKIP = 64  # empty groups a bank's grouped GEMM must leave out before it spans only the slots read


class CallPlan:
    """One layer call's arguments to :func:`~.kernel.grouped_experts`, from :meth:`Placement.plan_call`:
    ``slot_of`` [E] long on the device (the expert map), ``banks``, ``rows`` (token-expert rows of each bank,
    host ints; None: one bank, every row runs) and ``groups`` (the looped variant's groups of each bank with
    rows; None: grouped). One per placement, re-pointed every call: ``slot_of`` and ``banks`` are always the
    same objects, refilled."""

    __slots__ = ("slot_of", "banks", "rows", "groups")

    def __init__(self, slot_of: torch.Tensor, banks: list):
        self.slot_of, self.banks = slot_of, banks
        self.rows: Optional[list] = None
        self.groups: Optional[list] = None


class Placement(ArenaOccupancy):
    """The arena's occupancy (:class:`~.occupancy.ArenaOccupancy`) and each layer call's
    layout around its experts (module docstring)."""

    def __init__(self, layout, shapes: dict, dtype: torch.dtype, device: torch.device, tiers: dict, mover,
                 bytes_of: dict, store, name, mixed: bool = False, raw_layout: Optional[dict] = None, align: int = 1,
                 looped: bool = False, host_worker=None, identity: int = 0):
        """The occupancy's arguments (:class:`~.occupancy.ArenaOccupancy`), and: ``looped``: the kernel runs
        one GEMM per group (:func:`~.kernel.grouped_experts`'s ``groups``, made here from the host's routing);
        ``host_worker``: computes the host tier's bank (:mod:`.hostwork`: a worker thread beside the device, or
        inline first in the call)."""
        super().__init__(layout, shapes, dtype, device, tiers, mover, bytes_of, store, name, mixed, raw_layout, align)
        self.looped = looped
        self.host_runs = self.low_runs = 0
        self.stream_banks = [Bank({}, 0, 0) for _ in self.streams]
        self.work = Staging(shapes, dtype, device)  # experts put into place to run (unpacked, moved, host's)
        # host-computed experts run where they are, the host tier's bank, computed by ``host_worker``
        # (:mod:`.hostwork`); a tier without one (disk) copies them into the work bank
        self.host_in_place = hasattr(self.tier, "host_bank")
        # the layer call's expert map: filled on the host in a ring of pinned rows and uploaded once per call.
        # Two rows would do: a row is rewritten two calls later, after the next call's routing read-back,
        # which waits for everything issued before it (the upload included); four leave a margin.
        accel = accel_for(device)
        # (identity experts -- ids E .. E + identity - 1 -- are in the map, at the sentinel: nothing runs for them)
        self.width = self.E + identity
        self._ring = register_host(host_buffer(accel, 4, self.width, dtype=torch.int64))
        self._ring_np = self._ring.numpy()
        self._ring_i = 0
        self._slot_of = torch.empty(self.width, dtype=torch.int64, device=device)
        # the banks a layer call hands the kernel, made once and re-pointed per call
        self._banks: list = []
        self._arena_bank, self._work_bank, self._host_bank = Bank({}, 0, 0), Bank({}, 0, 0), Bank({}, 0, 0, host_worker)
        self._plan = CallPlan(self._slot_of, self._banks)

    # ---- one layer call: plan_call, then (the kernel), then finalize ---------------------------------------
    def plan_call(self, layer: int, running, host=(), low=None, index=None, all_run: bool = True) -> CallPlan:
        """Say where the running experts' weights are, and what each bank waits for: the call's
        :class:`CallPlan` for :func:`~.kernel.grouped_experts`, whose ``ready(bank)`` is :meth:`ready`.
        ``running``: the experts that run on the device this call (host ints); ``host``: experts computed from
        the host tier; ``low``: expert -> stored precision it runs at; ``index``: the call's selection on the
        host (``[T, k]``), for the rows of a call whose experts are in several banks or do not all run here
        (``all_run`` false: some may be dropped). Nothing waits here for a copy a bank does not need.

        1. the call's demand copies are submitted (:meth:`flush`); a mixed arena runs everything from the work
           bank, filled now, so the copies it is filled from are acquired;
        2. the banks are re-pointed at this call's tensors, each stream bank waiting for its job
           (:meth:`_point_banks`);
        3. the expert map: each running expert's global slot (:meth:`_map_running`), each host expert's
           (:meth:`_map_host`), then the host tier's bank; an expert that does not run here maps to the
           sentinel;
        4. each bank spans only the slots it reads, where that leaves out many (:meth:`_span_banks`);
        5. the rows of each bank (and the looped variant's groups) from the host's selection;
        6. the expert map is uploaded (one copy from the pinned ring)."""
        self.flush()  # 1
        staged_at = {s.expert: s for s in self._staged if s.layer == layer}
        if self.mixed:  # everything runs from the work bank, filled now: its sources must have landed
            self._acquire([s.ticket for s in self._staged] + [self.tickets[layer * self.E + e] for e in running])
        self.work.ensure((len(running) if self.mixed else 0) + (0 if self.host_in_place else len(host)))
        first_work = self._point_banks(layer)  # 2
        first_host = first_work + self.work.cap
        sentinel = first_host + (self.E if self.host_in_place and host else 0)
        m = self._ring_np[self._ring_i]  # 3
        m.fill(sentinel)
        w = self._map_running(layer, running, low, staged_at, m, first_work)
        if host:
            self._map_host(layer, host, m, first_work, first_host, w)
        banks = self._banks
        if sentinel > first_host:
            hb = self._host_bank
            hb.tensors, hb.first, hb.n = self.tier.host_bank(layer), first_host, self.E
            banks.append(hb)
        self._span_banks(m, sentinel)  # 4
        plan = self._plan  # 5
        if self.looped:
            plan.rows, plan.groups = self._groups(m, banks, index)
        else:
            plan.rows, plan.groups = self._rows(m, banks, index) if len(banks) > 1 or not all_run else None, None
        self._slot_of.copy_(self._ring[self._ring_i], non_blocking=True)  # 6
        self._ring_i = (self._ring_i + 1) % len(self._ring)
        return plan

    def _point_banks(self, layer: int) -> int:
        """Step 2 of :meth:`plan_call`: the call's banks, in global slot order -- the arena (uniform only), each
        stream bank grown so far, the work bank if any -- re-pointed at their tensors, the stream banks' tickets
        their jobs' (one per flush). Returns the work bank's first global slot."""
        banks = self._banks
        banks.clear()
        first = 0
        arena = self._arena_bank
        arena.tickets.clear()
        if not self.mixed:
            pool = self.pools[self.pool_of_layer[layer]]
            arena.tensors, arena.first, arena.n = pool.tensors, 0, pool.n
            banks.append(arena)
            first = pool.n
            for j, (st, bank) in enumerate(zip(self.streams, self.stream_banks)):
                bank.tickets.clear()
                if st.cap:
                    bank.tensors, bank.first, bank.n = st.tensors, first, st.cap
                    banks.append(bank)
                    for s in self._staged:  # (its streamed experts' job: one ticket each flush)
                        if s.bank == j and (not bank.tickets or bank.tickets[-1] is not s.ticket):
                            bank.tickets.append(s.ticket)
                first += st.cap
        work = self._work_bank
        if self.work.cap:
            work.tensors, work.first, work.n = self.work.tensors, first, self.work.cap
            banks.append(work)
        return first

    def _map_running(self, layer: int, running, low, staged_at: dict, m: np.ndarray, first_work: int) -> int:
        """Step 3 of :meth:`plan_call` for the experts that run on the device: ``m[e]``, each one's global slot
        (its arena slot, its stream row, or -- mixed -- the work row it is put into now), and the arena bank
        waits for its copy. Returns the work rows taken."""
        base = layer * self.E
        tickets, at = self.tickets, self.at
        arena, mixed = self._arena_bank, self.mixed
        w = 0
        for e in running:
            key = base + e
            t = tickets[key]
            if t is not None:  # the arena bank waits for it (a prefetch still queued is promoted then: late)
                arena.tickets.append(t)
                tickets[key] = None
            staged = staged_at.get(e)
            if mixed:  # into the work bank: unpacked from its stored copy, or moved out of the byte arena
                self._put(layer, e, low.get(e, "native") if low else "native", staged, w)
                m[e] = first_work + w
                w += 1
            elif staged is not None:
                m[e] = self.stream_banks[staged.bank].first + staged.row
            elif at[key] >= 0:
                m[e] = at[key]
            else:
                raise RuntimeError(f"execution=offload: {self.name(layer, e)} runs but is neither in the arena nor "
                                   f"staged (the arena and the engine disagree)")
        return w

    def _map_host(self, layer: int, host, m: np.ndarray, first_work: int, first_host: int, w: int) -> None:
        """Step 3 of :meth:`plan_call` for the experts computed from the host tier (miss=cpu_compute): in place
        (the host tier's bank, from ``first_host``) or copied to the device into work rows from ``w``."""
        for e in host:
            if self.host_in_place:
                m[e] = first_host + e
            else:
                self.tier.copy_into(layer, e, self.work.views(w))
                m[e] = first_work + w
                w += 1
            self.host_runs += 1

    def _span_banks(self, m: np.ndarray, sentinel: int) -> None:
        """Step 4 of :meth:`plan_call`: a bank's grouped GEMM spans only the slots it reads (``[lo, hi)``), where
        that leaves out many (a slice costs views; a few empty groups cost less)."""
        used = m[m < sentinel]  # the slots this call reads
        for b in self._banks:
            mine = used[(used >= b.first) & (used < b.first + b.n)]
            b.lo, b.hi = (int(mine.min()), int(mine.max()) + 1) if mine.size else (b.first, b.first)
            if b.n - (b.hi - b.lo) < SPAN_MIN_SKIP:
                b.lo, b.hi = b.first, b.first + b.n

    def ready(self, bank: Bank) -> None:
        """The kernel is about to read ``bank``: the copies into it are acquired (promoted if queued, waited for;
        on CUDA the compute stream waits on their events, the host does not)."""
        if bank.tickets:
            self._acquire(bank.tickets)
            bank.tickets.clear()

    def _put(self, layer: int, e: int, prec: str, staged: Optional[StagedCopy], row: int) -> None:
        """Expert ``e`` into work row ``row`` from a mixed arena or the stream's raw rows: its stored ``prec``
        copy unpacked (the store's own function: the simulated run's numbers), or its native copy moved."""
        key = layer * self.E + e
        if staged is not None:
            if staged.precision != prec:
                raise RuntimeError(f"execution=offload: {self.name(layer, e)} runs at {prec} but was streamed at "
                                   f"{staged.precision} (the executor and the engine disagree)")
            raw = self._stream_views(staged)
        else:
            if self.prec_of[key] != prec:
                raise RuntimeError(f"execution=offload: {self.name(layer, e)} runs at {prec} but the arena holds "
                                   f"{self.prec_of[key]} (the arena and the engine disagree)")
            raw = self.raw_views.at(self.pools[self.pool_of_layer[layer]].buf, self.at[key], layer, prec)
        dst = self.work.views(row)
        w = raw if prec == "native" else self.store.unpack(layer, prec, raw, self.device)
        for n in self.names:
            dst[n].copy_(w[n])
        if prec != "native":
            self.low_runs += 1

    def _counts(self, index) -> np.ndarray:
        """[E + identity] token-expert rows of each expert (and identity expert) in the call's selection (a host
        tensor: no synchronisation)."""
        return np.bincount(index.reshape(-1).numpy(), minlength=self.width)

    def _groups(self, m: np.ndarray, banks: list, index) -> tuple:
        """(rows of each bank, and for each bank with rows its groups as ``(end rows, slots)`` in slot order --
        the rows' order on the device -- rows counted from the bank's first, slots within the bank), from the
        host's selection."""
        counts = self._counts(index)
        sel = np.flatnonzero(counts)
        slots, cnt = m[sel], counts[sel]
        order = np.argsort(slots, kind="stable")
        slots, cnt = slots[order].tolist(), cnt[order].tolist()
        rows, groups, i = [], [], 0
        for b in banks:
            end, r, bounds, mine = b.first + b.n, 0, [], []
            while i < len(slots) and slots[i] < end:
                r += cnt[i]
                bounds.append(r)
                mine.append(slots[i] - b.first)
                i += 1
            rows.append(r)
            if r:
                groups.append((bounds, mine))
        return rows, groups

    def _rows(self, m: np.ndarray, banks: list, index) -> list:
        """Token-expert rows of each bank this call, from the selection on the host (``index``)."""
        if not banks:
            return []
        counts = self._counts(index)
        ends = np.array([b.first + b.n for b in banks])
        bank_of = np.searchsorted(ends, m, side="right")  # [E] the bank of each expert's slot; len(banks): none
        return np.bincount(bank_of, weights=counts, minlength=len(banks) + 1)[:len(banks)].astype(np.int64).tolist()

    def finalize(self) -> None:
        """The call's staging rows are free again; a copy submitted from now on into a slot or a staging row
        waits for the kernels issued so far, which may read what it overwrites (and only for those: the
        compute stream may run on meanwhile). A slot the engine frees was last read by a kernel issued before
        this point: the running call's experts are pinned, so no call frees what it reads."""
        self._after = self.mover.mark()
        self._staged.clear()
        self._stream_n[0] = self._stream_n[1] = 0

    def memory(self) -> dict:
        out = super().memory()
        out["staging_peak_bytes"] += self.work.bytes  # the stream banks' and the work bank's
        return out
