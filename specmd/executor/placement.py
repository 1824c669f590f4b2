"""Where every copy the engine keeps resident lives on the device, and the copies that put it there: the
"prepare / finalize" half of ``execution=offload`` (vLLM's split of a fused-MoE call into prepare, experts,
finalize; the experts half is :mod:`.kernel`).

:class:`Placement` is the engine's :class:`~specmd.engine.residency.ResidencyEvents` subscriber. It follows
the manager's events one for one and decides nothing:

1. **inserted** (a demand fetch or an admitted prefetch): a free slot of the layer's pool
   (:class:`~.arena.SlotArena`, or a byte range of a mixed :class:`~.arena.ByteArena`) is taken and the
   copy from the host tier is handed to the mover (:mod:`.transfer`). A layer call's demand copies go as
   **one job** for the arena and one per stream bank, submitted when the call's decisions are made (before
   its first prefetch, or when it runs); a prefetch is its own job, queued behind demand jobs;
2. **evicted**: the slot is freed (a copy still queued into it is cancelled; one under way lands first);
3. **streamed** (a demand miss no pool could hold): the bytes go to a row of a *stream* staging bank, for
   this call only (two banks: a double buffer, :meth:`streamed`).

Per layer call, :meth:`prepare` puts what does not run from a slot into place (stored low-precision copies
unpacked, a mixed arena's native copies, host-computed experts off a CPU) in the *work* staging bank, and
returns the layer call's expert map (expert id -> global slot id, uploaded once) and the banks
:func:`~.kernel.grouped_experts` runs, each with the copies it waits for; :meth:`ready` acquires them just
before that bank computes (a prefetch still queued is promoted: the simulated clock's late prefetch);
:meth:`finalize` releases the call's staging rows.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .host import register_host
from ..engine.residency import PoolLayout, ResidencyEvents
from .arena import ByteArena, SlotArena
from .kernel import Bank


DOUBLE_BUFFER_AFTER = 4  # streamed experts of a call that share one bank before the two banks alternate
SPAN_MIN_SKIP = 64  # empty groups a bank's grouped GEMM must leave out before it spans only the slots read
RAW = "__raw__"  # a mixed stream bank's one tensor: [rows, slot bytes] uint8


class Staging:
    """A growing bank of fused ``[rows, ...]`` tensors (one expert per row) on the device: a layer call's
    streamed experts, or the experts it puts into place to run. Grows geometrically, never shrinks; the
    largest it grew to is reported (``memory.staging_peak_bytes``)."""

    def __init__(self, shapes: dict, dtype: torch.dtype, device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.tensors: dict = {}
        self.cap = 0
        self._views: list = []
        self.row_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize

    def ensure(self, rows: int, keep: int = 0) -> None:
        """Room for ``rows`` rows; the first ``keep`` rows' contents survive a growth."""
        if rows <= self.cap:
            return
        cap = max(rows, 2 * self.cap, 1)
        new = {n: torch.zeros((cap, *s), dtype=self.dtype, device=self.device) for n, s in self.shapes.items()}
        if keep:
            for n, t in self.tensors.items():
                new[n][:keep].copy_(t[:keep])
        self.tensors, self.cap = new, cap
        self._views = [{n: t[r] for n, t in new.items()} for r in range(cap)]

    def views(self, row: int) -> dict:
        return self._views[row]

    @property
    def bytes(self) -> int:
        return self.cap * self.row_bytes


class Placement(ResidencyEvents):
    """The device side of the engine's residency (module docstring)."""

    def __init__(self, layout: PoolLayout, shapes: dict, dtype: torch.dtype, device: torch.device, tiers: dict,
                 mover, bytes_of: dict, store, name, mixed: bool = False, raw_layout: Optional[dict] = None,
                 align: int = 1, looped: bool = False, host_worker=None):
        """``shapes``: one expert's shape per fused parameter (the family's layout) at ``dtype``; ``tiers``:
        the host tier per stored precision ("native" always); ``bytes_of``: the engine's bytes per copy of each
        precision; ``store``: the quantized store (``unpack``); ``name(layer, expert)``: how errors name an
        expert; ``mixed``: copies of several precisions share the pools (byte arenas), whose raw tensors
        ``raw_layout[layer, precision]`` lists as ``[(name, dtype, shape, bytes)]``; ``looped``: the kernel runs
        one GEMM per group (:func:`~.kernel.grouped_experts`'s ``groups``, made here from the host's routing);
        ``host_worker``: computes the host tier's bank (:mod:`.hostwork`: a worker thread beside the device, or
        inline first in the call)."""
        E, L = layout.num_experts, layout.num_layers
        self.E = E
        self.device = device
        self.tiers, self.tier = tiers, tiers["native"]
        self.mover = mover
        self.bytes_of = bytes_of
        self.store = store
        self.name = name
        self.mixed = mixed
        self.looped = looped
        self.names = list(shapes)
        self.slot_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        self.pool_of_layer = list(layout.pool_of_layer)
        if mixed:
            self.pools = [ByteArena(c, self.slot_bytes, device, align) for c in layout.capacities]
        else:
            self.pools = [SlotArena(c, shapes, dtype, device) for c in layout.capacities]
        self.capacity_bytes = sum(a.capacity for a in self.pools)
        self._native_layout = [(n, dtype, s, math.prod(s) * dtype.itemsize) for n, s in shapes.items()]
        self._raw_layout = raw_layout or {}
        self._raw_cache: dict = {}
        # streamed experts (this call only): raw bytes of any precision (mixed), or native copies as fused rows in
        # two banks, a double buffer (streamed): each bank is copied as its own job, and the kernel computes one
        # bank's experts while the next bank's copies are still landing
        self.streams = [Staging({RAW: (self.slot_bytes,)}, torch.uint8, device)] if mixed else \
            [Staging(shapes, dtype, device), Staging(shapes, dtype, device)]
        self.stream_banks = [Bank({}, 0, 0) for _ in self.streams]
        self._stream_n = [0, 0]  # rows of each stream bank taken this call
        self._after = None  # the compute work a new copy waits for (Mover.mark at the last finalize)
        self.work = Staging(shapes, dtype, device)  # experts put into place to run (unpacked, moved, host's)
        # host-computed experts run where they are, the host tier's bank, computed by ``host_worker``
        # (:mod:`.hostwork`); a tier without one (disk) copies them into the work bank
        self.host_in_place = hasattr(self.tier, "host_bank")
        self.at = [-1] * (L * E)  # the slot (uniform) or byte offset (mixed) of each resident copy
        self.prec_of: list = [None] * (L * E)
        self.tickets: list = [None] * (L * E)
        # this call's streamed experts: [layer, expert, ticket (None until submitted), precision, stream bank, row]
        self._staged: list = []
        self._batch: list = []  # demand copies not yet submitted: (layer, expert, views or stream row, precision)
        self._batch_keys: list = []  # their cache keys (-1: streamed)
        self.used_bytes = self.peak_bytes = 0
        self.copies = self.host_runs = self.low_runs = 0
        self.jobs = 0  # copy jobs handed to the mover (a call's demand batch: one; each prefetch: one)
        self.bytes_submitted = 0  # bytes handed to the mover (demand batches and prefetches)
        self.stall_s = 0.0
        # the layer call's expert map: filled on the host in a ring of pinned rows and uploaded once per call.
        # Two rows would do: a row is rewritten two calls later, after the next call's routing read-back,
        # which waits for everything issued before it (the upload included); four leave a margin.
        pin = device.type == "cuda"
        self._ring = register_host(torch.empty(4, E, dtype=torch.int64, pin_memory=pin))
        self._ring_np = self._ring.numpy()
        self._ring_i = 0
        self._slot_of = torch.empty(E, dtype=torch.int64, device=device)
        # the banks a layer call hands the kernel, made once and re-pointed per call
        self._banks: list = []
        self._arena_bank, self._work_bank, self._host_bank = Bank({}, 0, 0), Bank({}, 0, 0), Bank({}, 0, 0, host_worker)

    # ---- events from the cache manager ------------------------------------------------------------------
    def inserted(self, key: int, layer: int, precision: str, prefetched: bool) -> None:
        pi = self.pool_of_layer[layer]
        arena = self.pools[pi]
        e = key - layer * self.E
        size = self.bytes_of[precision]
        off = arena.alloc(key, size)
        if off is None and self.mixed:  # bytes enough, no hole large enough: compact, then it fits
            self._compact(pi, size)
            off = arena.alloc(key, size)
        if off is None:
            raise RuntimeError(f"execution=offload: pool {pi} has no room for {self.name(layer, e)} ({size} bytes, "
                               f"{arena.used} of {arena.capacity} used), but the engine admitted it (the arena and "
                               f"the engine disagree)")
        self.at[key] = off
        self.prec_of[key] = precision
        views = self._views_of(key, layer, off, precision)
        self.used_bytes += size
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes
        self.copies += 1
        if not prefetched:  # a demand fetch: batched with the call's others
            self._batch.append((layer, e, views, precision))
            self._batch_keys.append(key)
            return
        self.flush()  # the call's demand copies go first, as the engine issued them
        tier = self.tiers[precision]
        self.bytes_submitted += size
        self.jobs += 1
        self.tickets[key] = self.mover.submit(lambda: tier.copy_into(layer, e, views), size, False, self.name(layer, e),
                                              after=self._after)

    def evicted(self, key: int) -> None:
        t = self.tickets[key]
        if t is None and key in self._batch_keys:  # demanded this call, not submitted yet: never copied
            i = self._batch_keys.index(key)
            del self._batch_keys[i], self._batch[i]
        elif t is not None and (t.done() or t.count > 1 or not self.mover.cancel(t)):
            # a copy into the slot is under way, batched, or issued (on CUDA done = issued): it lands before
            # anything the compute stream writes there later (a mixed arena's compaction)
            self.stall_s += self.mover.acquire(t)
        self.tickets[key] = None
        self.used_bytes -= self.bytes_of[self.prec_of[key]]
        self.pools[self.pool_of_layer[key // self.E]].release(key)
        self.at[key] = -1
        self.prec_of[key] = None

    def streamed(self, layer: int, expert: int, precision: str) -> None:
        i = len(self._staged)
        # the first DOUBLE_BUFFER_AFTER go to bank 0 (a decode's few: one bank, no extra launches), then the
        # two banks alternate (a prefill's many: one bank computes while the other's copies land)
        j = 0 if len(self.streams) == 1 or i < DOUBLE_BUFFER_AFTER else (i - DOUBLE_BUFFER_AFTER + 1) % 2
        row = self._stream_n[j]
        self._stream_n[j] += 1
        bank = self.streams[j]
        if row >= bank.cap:  # grows to the most experts one call streamed (memory.staging_peak_bytes)
            self._settle_stream()
            bank.ensure(row + 1, keep=row)
            self._raw_cache.clear()  # views of the old rows
        self._batch.append((layer, expert, i, precision))  # a stream row, resolved when the batch is submitted
        self._batch_keys.append(-1)
        self._staged.append([layer, expert, None, precision, j, row])  # its ticket: its bank's job's, at submission
        self.copies += 1

    def _stream_views(self, i: int, layer: int, precision: str) -> dict:
        j, row = self._staged[i][4:6]
        bank = self.streams[j]
        if not self.mixed:
            return bank.views(row)
        return self._raw_at(bank.tensors[RAW][row], 0, layer, precision)

    def _settle_stream(self) -> None:
        """Before the stream bank grows: this call's copies already submitted into it have landed (its rows are
        copied into the grown bank on the compute stream)."""
        self._acquire([s[2] for s in self._staged])

    def flush(self) -> None:
        """Submit the layer call's pending demand copies: the copies into the arena as one channel job (paced
        as that many transfers), then each stream bank's copies as one job (the double buffer)."""
        items = self._batch
        if not items:
            return
        jobs: list = [[] for _ in range(1 + len(self.streams))]  # [arena, stream bank 0, stream bank 1]
        for layer, e, dst, prec in items:
            if isinstance(dst, int):
                jobs[1 + self._staged[dst][4]].append((layer, e, self._stream_views(dst, layer, prec), prec, dst))
            else:
                jobs[0].append((layer, e, dst, prec, None))
        tickets = self.tickets
        keys = iter(k for k in self._batch_keys if k >= 0)
        for j, job in enumerate(jobs):
            if not job:
                continue
            t = self._submit(job)
            if j == 0:
                for _ in job:
                    tickets[next(keys)] = t
            else:
                for *_, i in job:
                    self._staged[i][2] = t
        self._batch, self._batch_keys = [], []

    def _submit(self, items: list):
        """One demand job copying ``items`` ``(layer, expert, destination views, precision, _)`` in order."""
        groups: dict[str, list] = {}
        for layer, e, dst, prec, _ in items:
            groups.setdefault(prec, []).append((layer, e, dst))
        nbytes = sum(self.bytes_of[it[3]] for it in items)
        self.bytes_submitted += nbytes
        self.jobs += 1
        jobs = [(self.tiers[q], g) for q, g in groups.items()]
        name = self.name

        def job():
            for tier, g in jobs:
                tier.copy_many(g, name)

        first = name(items[0][0], items[0][1])
        return self.mover.submit(job, nbytes, True, first + (f" and {len(items) - 1} more" if len(items) > 1 else ""),
                                 len(items), after=self._after)

    # ---- one layer call: prepare, then (the kernel), then finalize ----------------------------------------
    def prepare(self, layer: int, running, host=(), low=None, index=None, all_run: bool = True):
        """Say where the running experts' weights are, and what each bank waits for: ``(slot_of [E] on the
        device, banks, rows)`` for :func:`~.kernel.grouped_experts`, whose ``ready(bank)`` is :meth:`ready`.
        ``running``: the experts that run on the device this call (host ints); ``host``: experts computed from
        the host tier; ``low``: expert -> stored precision it runs at; ``index``: the call's selection on the
        host (``[T, k]``), for the rows of a call whose experts are in several banks or do not all run here
        (``all_run`` false: some may be dropped). Nothing waits here for a copy a bank does not need."""
        self.flush()
        E, base = self.E, layer * self.E
        tickets = self.tickets
        mixed = self.mixed
        pool = self.pools[self.pool_of_layer[layer]]
        staged_at = {s[1]: i for i, s in enumerate(self._staged) if s[0] == layer}
        if mixed:  # everything runs from the work bank, filled now: its sources must have landed
            self._acquire([s[2] for s in self._staged] + [tickets[base + e] for e in running])
        self.work.ensure((len(running) if mixed else 0) + (0 if self.host_in_place else len(host)))
        banks = self._banks
        banks.clear()
        first = 0
        arena = self._arena_bank
        arena.tickets.clear()
        if not mixed:
            arena.tensors, arena.first, arena.n = pool.tensors, 0, pool.n
            banks.append(arena)
            first = pool.n
            for j, (st, bank) in enumerate(zip(self.streams, self.stream_banks)):
                bank.tickets.clear()
                if st.cap:
                    bank.tensors, bank.first, bank.n = st.tensors, first, st.cap
                    banks.append(bank)
                    for s in self._staged:  # (its streamed experts' job: one ticket each flush)
                        if s[4] == j and (not bank.tickets or bank.tickets[-1] is not s[2]):
                            bank.tickets.append(s[2])
                first += st.cap
        work = self._work_bank
        if self.work.cap:
            work.tensors, work.first, work.n = self.work.tensors, first, self.work.cap
            banks.append(work)
        first_work = first
        first_host = first + self.work.cap
        sentinel = first_host + (E if self.host_in_place and host else 0)
        m = self._ring_np[self._ring_i]
        m.fill(sentinel)
        at = self.at
        w = 0
        for e in running:
            key = base + e
            t = tickets[key]
            if t is not None:  # the arena bank waits for it (a prefetch still queued is promoted then: late)
                arena.tickets.append(t)
                tickets[key] = None
            i = staged_at.get(e)
            if mixed:  # into the work bank: unpacked from its stored copy, or moved out of the byte arena
                self._put(layer, e, low.get(e, "native") if low else "native", i, w)
                m[e] = first_work + w
                w += 1
            elif i is not None:
                m[e] = self.stream_banks[self._staged[i][4]].first + self._staged[i][5]
            elif at[key] >= 0:
                m[e] = at[key]
            else:
                raise RuntimeError(f"execution=offload: {self.name(layer, e)} runs but is neither in the arena nor "
                                   f"staged (the arena and the engine disagree)")
        for e in host:  # miss=cpu_compute: from the host tier, where it is (a CPU device) or copied to the device
            if self.host_in_place:
                m[e] = first_host + e
            else:
                self.tier.copy_into(layer, e, self.work.views(w))
                m[e] = first_work + w
                w += 1
            self.host_runs += 1
        if sentinel > first_host:
            hb = self._host_bank
            hb.tensors, hb.first, hb.n = self.tier.host_bank(layer), first_host, E
            banks.append(hb)
        used = m[m < sentinel]  # the slots this call reads
        for b in banks:  # a bank's grouped GEMM spans only the slots it reads, where that leaves out many
            mine = used[(used >= b.first) & (used < b.first + b.n)]
            b.lo, b.hi = (int(mine.min()), int(mine.max()) + 1) if mine.size else (b.first, b.first)
            if b.n - (b.hi - b.lo) < SPAN_MIN_SKIP:  # (a slice costs views; a few empty groups cost less)
                b.lo, b.hi = b.first, b.first + b.n
        groups = None
        if self.looped:
            rows, groups = self._groups(m, banks, index)
        else:
            rows = self._rows(m, banks, index) if len(banks) > 1 or not all_run else None
        self._slot_of.copy_(self._ring[self._ring_i], non_blocking=True)
        self._ring_i = (self._ring_i + 1) % len(self._ring)
        return self._slot_of, banks, rows, groups

    def ready(self, bank: Bank) -> None:
        """The kernel is about to read ``bank``: the copies into it are acquired (promoted if queued, waited for;
        on CUDA the compute stream waits on their events, the host does not)."""
        if bank.tickets:
            self._acquire(bank.tickets)
            bank.tickets.clear()

    def _acquire(self, tickets) -> None:
        """Acquire ``tickets`` (a batch job's ticket, standing for several experts, once in a row; acquiring a
        done one again costs nothing)."""
        last = None
        for t in tickets:
            if t is not None and t is not last:
                self.stall_s += self.mover.acquire(t)
                last = t

    def _put(self, layer: int, e: int, prec: str, staged: Optional[int], row: int) -> None:
        """Expert ``e`` into work row ``row`` from a mixed arena or the stream's raw rows: its stored ``prec``
        copy unpacked (the store's own function: the simulated run's numbers), or its native copy moved."""
        key = layer * self.E + e
        if staged is not None:
            if self._staged[staged][3] != prec:
                raise RuntimeError(f"execution=offload: {self.name(layer, e)} runs at {prec} but was streamed at "
                                   f"{self._staged[staged][3]} (the executor and the engine disagree)")
            raw = self._stream_views(staged, layer, prec)
        else:
            if self.prec_of[key] != prec:
                raise RuntimeError(f"execution=offload: {self.name(layer, e)} runs at {prec} but the arena holds "
                                   f"{self.prec_of[key]} (the arena and the engine disagree)")
            raw = self._raw_at(self.pools[self.pool_of_layer[layer]].buf, self.at[key], layer, prec)
        dst = self.work.views(row)
        w = raw if prec == "native" else self.store.unpack(layer, prec, raw, self.device)
        for n in self.names:
            dst[n].copy_(w[n])
        if prec != "native":
            self.low_runs += 1

    def _counts(self, index) -> np.ndarray:
        """[E] token-expert rows of each expert in the call's selection (a host tensor: no synchronisation)."""
        return np.bincount(index.reshape(-1).numpy(), minlength=self.E)

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

    # ---- views into the arena ---------------------------------------------------------------------------
    def _views_of(self, key: int, layer: int, off: int, precision: str) -> dict:
        if not self.mixed:
            return self.pools[self.pool_of_layer[layer]].views(off)
        return self._raw_at(self.pools[self.pool_of_layer[layer]].buf, off, layer, precision)

    def _raw_at(self, buf: torch.Tensor, offset: int, layer: int, precision: str) -> dict:
        """Views of one copy's tensors at byte ``offset`` of a 1-D byte buffer (a mixed arena, a stream row),
        remembered per (buffer, offset, layout): making them is up to 18 tensor calls, and copies keep landing
        at the same offsets (sizes repeat). At most 8192 remembered (then forgotten at once)."""
        layout = self._native_layout if precision == "native" else self._raw_layout[layer, precision]
        ck = (buf.data_ptr(), offset, id(layout))
        out = self._raw_cache.get(ck)
        if out is None:
            if len(self._raw_cache) >= 8192:
                self._raw_cache.clear()
            out, o = {}, offset
            for n, dtype, shape, nbytes in layout:
                out[n] = buf[o:o + nbytes].view(dtype).view(shape)
                o += nbytes
            self._raw_cache[ck] = out
        return out

    def _compact(self, pi: int, need: int) -> None:
        """Defragment mixed pool ``pi`` until ``need`` bytes are one hole: the copies in the range to slide
        must have landed (those still in flight are promoted and waited for), then they move down. Copies
        outside the range are not waited for."""
        self.flush()
        arena = self.pools[pi]
        span = arena.window(need)
        self._acquire([self.tickets[key] for key in arena.inside(*span)])
        for key, off in arena.compact(span=span).items():  # views re-made when the copy next runs
            self.at[key] = off

    # ---- checks -------------------------------------------------------------------------------------------
    def check(self, entries: dict, pools: list, contents: bool = True) -> None:
        """The arena holds exactly the engine's resident set (``entries``: key -> entry with ``precision``;
        ``pools``: each pool's ``capacity`` and ``used``): every entry has its bytes at its precision, no range
        is held for an expert the engine does not have, used bytes equal each pool's; with ``contents``, each
        arrived copy's bytes are its expert's (compared with the host tier)."""
        held = {k for k, o in enumerate(self.at) if o >= 0}
        keys = set(entries)
        if held != keys:
            raise AssertionError(f"arena holds {sorted(held - keys)[:8]} the engine does not; engine holds "
                                 f"{sorted(keys - held)[:8]} the arena does not")
        for key in held:
            if self.prec_of[key] != entries[key].precision:
                raise AssertionError(f"key {key}: the arena holds {self.prec_of[key]}, the engine "
                                     f"{entries[key].precision}")
        for pi, pool in enumerate(pools):
            arena = self.pools[pi]
            if arena.used > pool.capacity:
                raise AssertionError(f"pool {pi}: {arena.used} bytes exceed {pool.capacity}")
            if arena.used != pool.used:
                raise AssertionError(f"pool {pi}: arena uses {arena.used} bytes, engine {pool.used}")
            if self.mixed:
                spans = sorted(list(arena.live.values()) + arena.holes())
                if any(a[0] + a[1] > b[0] for a, b in zip(spans, spans[1:])):
                    raise AssertionError(f"pool {pi}: overlapping ranges {spans[:8]}")
            elif sorted(list(arena.live.values()) + arena.holes()) != list(range(arena.n)):
                raise AssertionError(f"pool {pi}: held and free slots do not partition its {arena.n} slots")
        if not contents:
            return
        self.mover.sync()  # (on CUDA a done copy was issued, maybe not landed)
        for key in held:
            t = self.tickets[key]
            if t is not None and not t.done():
                continue
            layer, e = divmod(key, self.E)
            prec = self.prec_of[key]
            views = self._views_of(key, layer, self.at[key], prec)
            if prec == "native":
                want = {n: torch.empty(s, dtype=d) for n, d, s, _ in self._native_layout}
                self.tier.copy_into(layer, e, want)
            else:
                want = self.store.raw(layer, e, prec)
            for n in want:
                if n in views and not torch.equal(views[n].cpu(), want[n]):
                    raise AssertionError(f"slot of layer {layer} expert {e} does not hold its bytes ({n})")

    def memory(self) -> dict:
        return {
            "arena_capacity_bytes": self.capacity_bytes,
            "arena_slots": sum(a.capacity // self.slot_bytes for a in self.pools),  # native one-expert slots
            "arena_layout": "mixed" if self.mixed else "uniform",
            "arena_compactions": sum(a.compactions for a in self.pools),
            "arena_bytes_compacted": sum(a.bytes_compacted for a in self.pools),
            "slot_bytes": self.slot_bytes,
            "arena_peak_bytes": self.peak_bytes,
            "staging_peak_bytes": sum(st.bytes for st in self.streams) + self.work.bytes,
        }
