"""The arena's occupancy: the device side of the engine's residency in ``execution=offload``, the subscriber that follows the cache
manager's :class:`~specmd.engine.events.ResidencyEvents` one for one, and decides nothing:

1. **inserted** (a demand fetch or an admitted prefetch): a free slot of the layer's pool
   (:class:`~.arena.SlotArena`, or a byte range of a mixed :class:`~.arena.ByteArena`) is taken and the
   copy from the host tier is handed to the mover (:mod:`.transfer`). A layer call's demand copies go as
   **one job** for the arena and one per stream bank, submitted when the call's decisions are made (before
   its first prefetch, or when it runs: :meth:`~ArenaOccupancy.flush`); a prefetch is its own job, queued
   behind demand jobs;
2. **evicted**: the slot is freed (a copy still queued into it is cancelled; one under way lands first);
3. **streamed** (a demand miss no pool could hold): the bytes go to a row of a *stream* staging bank, for
   this call only (two banks: a double buffer), a :class:`StagedCopy`.

Each copy's ticket (the mover's) is kept until the copy is acquired; :meth:`~ArenaOccupancy.check` asserts
the arena holds exactly the engine's resident set. The layer call's layout around the experts (banks,
expert map, rows) is :class:`~.placement.Placement`'s, which extends this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..engine.events import PoolLayout, ResidencyEvents, ResidentSet
from .arena import ByteArena, RawViews, SlotArena, Staging


DOUBLE_BUFFER_AFTER = 4  # streamed experts of a call that share one bank before the two banks alternate
RAW = "__raw__"  # a mixed stream bank's one tensor: [rows, slot bytes] uint8


@dataclass(slots=True, eq=False)
class StagedCopy:
    """One streamed expert of this layer call (:meth:`ArenaOccupancy.streamed`): ``expert`` of ``layer`` at
    ``precision``, in row ``row`` of stream bank ``bank``; ``ticket``: its bank's copy job, None until the
    call's demand copies are submitted (:meth:`ArenaOccupancy.flush`)."""

    layer: int
    expert: int
    precision: str
    bank: int
    row: int
    ticket: Any = None


class ArenaOccupancy(ResidencyEvents):
    """The engine's residency carried out in the device arena (module docstring)."""

    def __init__(self, layout: PoolLayout, shapes: dict, dtype: torch.dtype, device: torch.device, tiers: dict,
                 mover, bytes_of: dict, store, name, mixed: bool = False, raw_layout: Optional[dict] = None,
                 align: int = 1):
        """``shapes``: one expert's shape per fused parameter (the family's layout) at ``dtype``; ``tiers``:
        the host tier per stored precision ("native" always); ``bytes_of``: the engine's bytes per copy of each
        precision; ``store``: the quantized store (``raw``, ``unpack``); ``name(layer, expert)``: how errors
        name an expert; ``mixed``: copies of several precisions share the pools (byte arenas), whose raw
        tensors ``raw_layout[layer, precision]`` lists as ``[(name, dtype, shape, bytes)]``."""
        E, L = layout.num_experts, layout.num_layers
        self.E = E
        self.device = device
        self.tiers, self.tier = tiers, tiers["native"]
        self.mover = mover
        self.bytes_of = bytes_of
        self.store = store
        self.name = name
        self.mixed = mixed
        self.names = list(shapes)
        self.slot_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        self.pool_of_layer = list(layout.pool_of_layer)
        if mixed:
            self.pools = [ByteArena(c, self.slot_bytes, device, align) for c in layout.capacities]
        else:
            self.pools = [SlotArena(c, shapes, dtype, device) for c in layout.capacities]
        self.capacity_bytes = sum(a.capacity for a in self.pools)
        self.raw_views = RawViews([(n, dtype, s, math.prod(s) * dtype.itemsize) for n, s in shapes.items()],
                                  raw_layout or {})  # copies' views in byte buffers (mixed)
        # streamed experts (this call only): raw bytes of any precision (mixed), or native copies as fused rows in
        # two banks, a double buffer (streamed): each bank is copied as its own job, and the kernel computes one
        # bank's experts while the next bank's copies are still landing
        self.streams = [Staging({RAW: (self.slot_bytes,)}, torch.uint8, device)] if mixed else \
            [Staging(shapes, dtype, device), Staging(shapes, dtype, device)]
        self._stream_n = [0, 0]  # rows of each stream bank taken this call
        self._after = None  # the compute work a new copy waits for (Mover.mark at the last finalize)
        self.at = [-1] * (L * E)  # the slot (uniform) or byte offset (mixed) of each resident copy
        self.prec_of: list = [None] * (L * E)
        self.tickets: list = [None] * (L * E)
        self._staged: list[StagedCopy] = []  # this call's streamed experts
        # demand copies not yet submitted: (layer, expert, views or its StagedCopy, precision), and their cache
        # keys (-1: streamed)
        self._batch: list = []
        self._batch_keys: list = []
        self.used_bytes = self.peak_bytes = 0
        self.copies = 0
        self.jobs = 0  # copy jobs handed to the mover (a call's demand batch: one; each prefetch: one)
        self.bytes_submitted = 0  # bytes handed to the mover (demand batches and prefetches)
        self.stall_s = 0.0

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
        views = self._views_of(layer, off, precision)
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
            self.raw_views.clear()  # views of the old rows
        staged = StagedCopy(layer, expert, precision, j, row)  # its ticket: its bank's job's, at submission
        self._batch.append((layer, expert, staged, precision))  # its views resolved when the batch is submitted
        self._batch_keys.append(-1)
        self._staged.append(staged)
        self.copies += 1

    def _stream_views(self, staged: StagedCopy) -> dict:
        """Where a streamed copy lands: its stream row's views (a mixed bank's raw row, as its precision's)."""
        bank = self.streams[staged.bank]
        if not self.mixed:
            return bank.views(staged.row)
        return self.raw_views.at(bank.tensors[RAW][staged.row], 0, staged.layer, staged.precision)

    def _settle_stream(self) -> None:
        """Before the stream bank grows: this call's copies already submitted into it have landed (its rows are
        copied into the grown bank on the compute stream)."""
        self._acquire([s.ticket for s in self._staged])

    # ---- copy jobs ----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit the layer call's pending demand copies: the copies into the arena as one channel job (paced
        as that many transfers), then each stream bank's copies as one job (the double buffer)."""
        items = self._batch
        if not items:
            return
        jobs: list = [[] for _ in range(1 + len(self.streams))]  # [arena, stream bank 0, stream bank 1]
        for layer, e, dst, prec in items:
            if isinstance(dst, StagedCopy):
                jobs[1 + dst.bank].append((layer, e, self._stream_views(dst), prec, dst))
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
                for *_, staged in job:
                    staged.ticket = t
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

    def _acquire(self, tickets) -> None:
        """Acquire ``tickets`` (a batch job's ticket, standing for several experts, once in a row; acquiring a
        done one again costs nothing)."""
        last = None
        for t in tickets:
            if t is not None and t is not last:
                self.stall_s += self.mover.acquire(t)
                last = t

    # ---- views into the arena ---------------------------------------------------------------------------
    def _views_of(self, layer: int, off: int, precision: str) -> dict:
        """The views of a resident copy at slot or byte offset ``off`` of its layer's pool."""
        if not self.mixed:
            return self.pools[self.pool_of_layer[layer]].views(off)
        return self.raw_views.at(self.pools[self.pool_of_layer[layer]].buf, off, layer, precision)

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

    # ---- checks and results -------------------------------------------------------------------------------
    def check(self, resident: ResidentSet, contents: bool = True) -> None:
        """The arena holds exactly the engine's resident set (``resident``: the cache manager, read through
        the seam's :class:`~specmd.engine.events.ResidentSet`): every entry has its bytes at its precision,
        no range is held for an expert the engine does not have, used bytes equal each pool's; with
        ``contents``, each arrived copy's bytes are its expert's (compared with the host tier)."""
        entries = resident.entries
        held = {k for k, o in enumerate(self.at) if o >= 0}
        keys = set(entries)
        if held != keys:
            raise AssertionError(f"arena holds {sorted(held - keys)[:8]} the engine does not; engine holds "
                                 f"{sorted(keys - held)[:8]} the arena does not")
        for key in held:
            if self.prec_of[key] != entries[key].precision:
                raise AssertionError(f"key {key}: the arena holds {self.prec_of[key]}, the engine "
                                     f"{entries[key].precision}")
        for pi, pool in enumerate(resident.pools):
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
        if contents:
            self._check_contents(held)

    def _check_contents(self, held: set) -> None:
        """Each arrived copy among ``held`` (keys) holds its expert's bytes (compared with the host tier)."""
        # the copies done *before* the sync (on CUDA a done copy was issued, maybe not landed; one that the
        # transfer thread finishes issuing after the sync has not landed: the CUDA stand-in caught this check
        # reading such a slot)
        arrived = [key for key in held if self.tickets[key] is None or self.tickets[key].done()]
        self.mover.sync()
        for key in arrived:
            layer, e = divmod(key, self.E)
            prec = self.prec_of[key]
            views = self._views_of(layer, self.at[key], prec)
            if prec == "native":
                want = {n: torch.empty(s, dtype=d) for n, d, s, _ in self.raw_views.native}
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
            "staging_peak_bytes": sum(st.bytes for st in self.streams),  # (Placement adds its work bank's)
        }
