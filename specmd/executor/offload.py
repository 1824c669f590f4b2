"""``execution=offload``: the device holds the dense weights and one pre-allocated expert arena of exactly
the configured capacity; expert weights live only in a host tier (:mod:`.tiers`); every decision of the
cache manager is carried out for real (Fiddler's pre-allocated slots and transfer stream, SpecMD's watchdog
thread):

1. **insert** (a demand fetch or a prefetch the engine admitted): a free slot of the layer's pool is taken
   and the expert's bytes are copied into it from the tier by the transfer channel (:mod:`.transfer`),
   demand jobs first, prefetches queued behind them and overlapping compute. A layer call's demand fetches
   (and streamed experts) go as **one job**, submitted when the call's decisions are made (before its first
   prefetch, or when it runs): one hand-off to the transfer thread instead of one per expert;
2. **evict**: the slot is freed (a copy still queued into it is cancelled, one under way is waited for);
3. **stream** (a demand miss the engine could not cache): the bytes go to a staging slot for this call only;
4. **run**: compute waits for the tickets of the experts it runs (a prefetch still queued is promoted
   first: the late prefetch of the simulated clock), then :func:`~.kernel.run_experts` reads each expert
   from its slot (``miss=cpu_compute``'s experts from host memory; dropped ones not at all).

The executor decides nothing: slots follow the engine's events one for one, and ``execution.check=true``
asserts after every layer call that the arena holds exactly the engine's resident set, byte for byte.
Stored low-precision copies (``miss=fetch_lowest_bit``, ``fetch_priority``, ...) move as their own bytes -- bit-packed
weights, fp16 scale and zero (:meth:`~specmd.quant.base.ExpertStore.raw`), never dequantized floats -- into arena
ranges of their size (:mod:`.arena`'s mixed layout), and are unpacked by the store's own function when they run,
so their outputs are the simulated run's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import torch

from ..errors import ConfigError
from .base import EXECUTION, Executor
from .kernel import expert_tensors, run_experts, weight_names
from .transfer import CudaMover, ThreadMover

HOSTS = ("ram", "disk")
PAGE_CACHE = ("drop", "keep")


@EXECUTION.register("offload")
class Offload(Executor):
    offloads = True

    @dataclass
    class Params:
        host: str = "ram"  # ram: experts in host memory (pinned on CUDA); disk: read per expert from the checkpoint
        throttle: bool = True  # pace transfers to hardware.bandwidth_gbps + latency_us (false: the machine's speed)
        page_cache: str = "drop"  # disk: drop each read's pages from the page cache (every fetch reads the disk) | keep
        check: bool = False  # after every layer call, assert the arena equals the engine's resident set (tests)

        def __post_init__(self):
            if self.host not in HOSTS:
                raise ValueError(f"host={self.host!r}; valid choices: {', '.join(HOSTS)}")
            if self.page_cache not in PAGE_CACHE:
                raise ValueError(f"page_cache={self.page_cache!r}; valid choices: {', '.join(PAGE_CACHE)}")

    # ---- set-up: tier, arena, slots, transfer channel -------------------------------------------------
    def attach(self, stack) -> None:
        super().attach(stack)
        p = self.params
        geom, cache = stack.geom, stack.cache
        E, L = geom.num_experts, geom.num_layers
        self.E = E
        self._device = dev = stack.device
        mods = stack.expert_modules
        tensors = [expert_tensors(m, E) for m in mods]
        self.names = list(tensors[0])
        shapes = {n: tuple(t.shape[1:]) for n, t in tensors[0].items()}
        self.dtype = dtype = tensors[0][self.names[0]].dtype
        self.slot_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
        store = stack.store
        if self.slot_bytes != store.bytes_of["native"]:
            raise ConfigError(f"execution=offload: one expert is {self.slot_bytes} bytes in its tensors but the "
                              f"engine counts {store.bytes_of['native']} (hardware.timing_as cannot be offloaded)")
        self.bytes_of = dict(store.bytes_of)
        low = [q for q in store.precisions if q != "native"]
        # the host tier of native experts
        if p.host == "ram":
            from .tiers import RamTier

            self.tier = RamTier(tensors, pin=dev.type == "cuda")
            if set(self.tier.row_bytes) != {self.slot_bytes}:  # a slot is filled by one copy of a packed row
                raise RuntimeError(f"execution=offload: packed experts of {sorted(set(self.tier.row_bytes))} bytes "
                                   f"do not match the {self.slot_bytes}-byte slots")
        else:
            from .tiers import DiskTier

            if not stack.checkpoint:
                raise ConfigError("execution.host=disk reads experts from a local checkpoint directory: set "
                                  "model.pretrained to one (or use execution.host=ram)")
            self.tier = DiskTier(stack.checkpoint, list(geom.layer_ids), shapes, dtype, E, p.page_cache, dev)
        # stored low-precision copies: their raw bytes (bit-packed weights, fp16 scale/zero, native biases)
        # packed per layer as [E, bytes of the copy] rows in host memory, one memmove per fetch
        self.tiers = {"native": self.tier}
        self._raw_layout: dict[tuple, list] = {}  # (layer, precision) -> [(name, dtype, shape, bytes)]; equal ones shared
        self._raw_cache: dict[tuple, dict] = {}
        if low:
            if not store.packable:
                raise ConfigError(f"execution=offload: the store's {', '.join(low)} copies have no raw bytes to move "
                                  f"(quant method without ExpertStore.raw)")
            from .tiers import RamTier

            for q in low:
                rows = []
                for layer in range(L):
                    raws = [store.raw(layer, e, q) for e in range(E)]
                    lay = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in raws[0].items()]
                    self._raw_layout[layer, q] = next((v for v in self._raw_layout.values() if v == lay), lay)
                    rows.append({n: torch.stack([r[n] for r in raws]) for n in raws[0]})
                self.tiers[q] = RamTier(rows, pin=dev.type == "cuda")
                if set(self.tiers[q].row_bytes) != {self.bytes_of[q]}:
                    raise RuntimeError(f"execution=offload: {q} copies pack to {sorted(set(self.tiers[q].row_bytes))} "
                                       f"bytes, the engine counts {self.bytes_of[q]}")
        # the arena: one buffer per pool, exactly its capacity (uniform one-expert slots unless copies of
        # several sizes share it: then every copy's size must keep the next one aligned for its tensors' dtypes)
        from .arena import Arena

        align = max([dtype.itemsize] + [d.itemsize for lay in self._raw_layout.values() for _, d, _, _ in lay])
        for q, n in self.bytes_of.items():
            if low and n % align:
                raise ConfigError(f"execution=offload: a {q} copy is {n} bytes, not a multiple of {align} (the widest "
                                  f"element its arena neighbours hold), so copies of several precisions cannot share "
                                  f"a pool; fetch one precision, or use execution=simulated")
        for (layer, q), lay in self._raw_layout.items():
            o = 0
            for n, d, _, nb in lay:
                if o % d.itemsize:
                    raise ConfigError(f"execution=offload: {q} copy's {n} starts at byte {o}, not aligned to its {d}")
                o += nb

        self._native_layout = [(n, dtype, s, math.prod(s) * dtype.itemsize) for n, s in shapes.items()]
        self.pool_index = [cache.pools.index(pool) for pool in cache._pool_of_layer]
        self.pools = [Arena(pool.capacity, self.slot_bytes, dev, bool(low), self._views_at, align)
                      for pool in cache.pools]
        self.capacity_bytes = sum(a.capacity for a in self.pools)
        self.peak_bytes = self.used_bytes = 0
        self.staging: list[tuple] = []  # (buffer, native views) for streamed experts (grow only; reported)
        self._staged: list = []  # (layer, expert, ticket, raw views or None) of this layer call
        self._batch: list = []  # this layer call's demand copies not yet submitted: (layer, expert, views, precision)
        self._batch_keys: list = []  # their cache keys (-1: streamed)
        self.at = [-1] * (L * E)  # byte offset of each resident copy in its pool's arena
        self.prec_of: list = [None] * (L * E)
        self.raw_views: dict[int, dict] = {}  # key -> views of a low-precision copy's raw tensors in its slot
        self.tickets: list = [None] * (L * E)
        self.sources = [{n: [None] * E for n in self.names} for _ in range(L)]
        self.up = weight_names(mods[0])[0]
        hw = stack.spec.hardware
        bw = hw.bandwidth_gbps * 1e9 if p.throttle else None
        lat = hw.latency_us * 1e-6 if p.throttle else 0.0
        if dev.type == "cuda":
            import logging

            logging.getLogger("specmd").warning(
                "execution=offload on CUDA: this path has not run on a GPU in specmd's CI (it has none); "
                "check it with `python benchmarks/offload.py --device cuda` and report what it prints")
            self.mover = CudaMover(bw, lat, dev)
        else:
            self.mover = ThreadMover(bw, lat)
        self.copies = 0
        self.host_runs = 0
        self.low_runs = 0
        cache.events = self

    # ---- events from the cache manager ------------------------------------------------------------------
    def inserted(self, key: int, layer: int, precision: str, prefetched: bool) -> None:
        pi = self.pool_index[layer]
        arena = self.pools[pi]
        e = key - layer * self.E
        size = self.bytes_of[precision]
        off = arena.alloc(key, size)
        if off is None and arena.mixed:  # bytes enough, no hole large enough: compact, then it fits
            self._compact(pi, size)
            off = arena.alloc(key, size)
        if off is None:
            raise RuntimeError(f"execution=offload: pool {pi} has no room for MoE layer {layer} (model.layers."
                               f"{self.stack.moe_ids[layer]}) expert {e} ({size} bytes, {arena.used} of "
                               f"{arena.capacity} used), but the engine admitted it (the arena and the engine disagree)")
        self.at[key] = off
        self.prec_of[key] = precision
        views = self._place(key, layer, e, arena, off, precision)
        self.used_bytes += size
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes
        self.copies += 1
        if not prefetched:  # a demand fetch: batched with the call's others
            self._batch.append((layer, e, views, precision))
            self._batch_keys.append(key)
            return
        self._flush()  # the call's demand copies go first, as the engine issued them
        self.tickets[key] = self.mover.submit(partial(self.tiers[precision].copy_into, layer, e, views), size,
                                              False, self._name(layer, e))

    def _place(self, key, layer, e, arena, off, precision) -> dict:
        """Point the layer's sources at a copy's views in the arena (a low-precision copy: its raw views,
        unpacked when it runs)."""
        src = self.sources[layer]
        if precision == "native":
            views = arena.slots[off // self.slot_bytes] if not arena.mixed else self._raw_at(arena.buf, off, layer, "native")
            for n in self.names:
                src[n][e] = views[n]
            return views
        views = self.raw_views[key] = self._raw_at(arena.buf, off, layer, precision)
        return views

    def _compact(self, pi: int, need: int) -> None:
        """Defragment pool ``pi`` until ``need`` bytes are one hole: the copies in the range to slide must have
        landed (wait for those still in flight: promoted first), then they move down and their views are
        re-pointed. Copies outside the range are not waited for."""
        self._flush()
        arena = self.pools[pi]
        span = arena.window(need)
        for key in arena.inside(*span):
            t = self.tickets[key]
            if t is not None and not t.done():
                self.mover.promote(t)
                self.stall_s += self.mover.wait(t)
        for key, off in arena.compact(span=span).items():  # views re-made when the copy next runs (most never do)
            self.at[key] = off
            layer, e = divmod(key, self.E)
            self.raw_views.pop(key, None)
            if self.prec_of[key] == "native":
                src = self.sources[layer]
                for n in self.names:
                    src[n][e] = None

    def _flush(self) -> None:
        """Submit the layer call's pending demand copies as one channel job (paced as that many transfers)."""
        items = self._batch
        if not items:
            return
        groups: dict[str, list] = {}
        for layer, e, views, prec in items:
            groups.setdefault(prec, []).append((layer, e, views))
        nbytes = sum(self.bytes_of[prec] for *_, prec in items)
        t = self.mover.submit(partial(self._copy_groups, [(self.tiers[q], g) for q, g in groups.items()]), nbytes,
                              True, self._name(items[0][0], items[0][1]) + (f" and {len(items) - 1} more"
                                                                            if len(items) > 1 else ""), len(items))
        tickets = self.tickets
        for key in self._batch_keys:
            if key >= 0:
                tickets[key] = t
        if self._staged:
            self._staged = [(lay, e, t if tk is None else tk, raw) for lay, e, tk, raw in self._staged]
        self._batch, self._batch_keys = [], []

    def _copy_groups(self, groups) -> None:
        for tier, items in groups:
            tier.copy_many(items, self._name)

    def _name(self, layer: int, expert: int) -> str:
        return f"model.layers.{self.stack.moe_ids[layer]} expert {expert}"

    def evicted(self, key: int) -> None:
        t = self.tickets[key]
        if t is None and key in self._batch_keys:  # demanded this call, not submitted yet: never copied
            i = self._batch_keys.index(key)
            del self._batch_keys[i], self._batch[i]
        elif t is not None and not t.done() and (t.count > 1 or not self.mover.cancel(t)):
            self.stall_s += self.mover.wait(t)  # a copy into the slot is under way (or batched): let it land
        self.tickets[key] = None
        layer, e = divmod(key, self.E)
        self.used_bytes -= self.bytes_of[self.prec_of[key]]
        self.pools[self.pool_index[layer]].release(key)
        self.at[key] = -1
        self.prec_of[key] = None
        self.raw_views.pop(key, None)
        src = self.sources[layer]
        for n in self.names:
            src[n][e] = None

    def streamed(self, layer: int, expert: int, precision: str) -> None:
        i = len(self._staged)
        if i == len(self.staging):  # grows to the most experts one call streamed (memory.staging_peak_bytes)
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self._device)
            self.staging.append((buf, self._views_at(buf, 0)))
        buf, views = self.staging[i]
        raw = None
        if precision != "native":
            views = raw = self._raw_at(buf, 0, layer, precision)
        else:
            src = self.sources[layer]
            for n in self.names:
                src[n][expert] = views[n]
        self._batch.append((layer, expert, views, precision))
        self._batch_keys.append(-1)
        self._staged.append((layer, expert, None, raw))  # its ticket: the batch's, at submission
        self.copies += 1

    # ---- one layer call ---------------------------------------------------------------------------------
    def run(self, mod, hidden, index, weights, plan):
        layer = mod.layer
        E = self.E
        host, low = (), None
        if plan is not None:
            index, weights = plan.index, plan.weights
            host = plan.host
            low = plan.precisions
            emap = plan.expert_map.tolist()
            running = [e for e in range(E) if emap[e] >= 0]
        else:
            running = torch.bincount(index.reshape(-1), minlength=E).nonzero().squeeze(1).tolist()
        base = layer * E
        self._flush()
        mover, tickets = self.mover, self.tickets
        for _, _, t, _ in self._staged:
            if not t.done():
                self.stall_s += mover.wait(t)
            elif t.error is not None:
                mover.wait(t)  # raises, naming the expert
        src = self.sources[layer]
        if low:  # low-precision copies run from their bytes, unpacked (the store's own unpack: simulated's numbers)
            staged = {e: raw for lay, e, _, raw in self._staged if raw is not None and lay == layer}
            store = self.stack.store
            for e, prec in low.items():
                t = tickets[base + e]
                if t is not None and (not t.done() or t.error is not None):
                    mover.promote(t)
                    self.stall_s += mover.wait(t)  # raises if the copy failed: never unpack what did not arrive
                raw = staged.get(e)
                if raw is None:
                    if self.prec_of[base + e] != prec:
                        raise RuntimeError(f"execution=offload: {self._name(layer, e)} runs at {prec} but the arena "
                                           f"holds {self.prec_of[base + e]} (the arena and the engine disagree)")
                    raw = self.raw_views.get(base + e)
                    if raw is None:  # moved by a compaction since it was placed
                        raw = self._place(base + e, layer, e, self.pools[self.pool_index[layer]], self.at[base + e],
                                          prec)
                w = store.unpack(layer, prec, raw, self._device)
                for n in self.names:
                    src[n][e] = w[n]
                self.low_runs += 1
        up = src[self.up]
        for e in running:
            t = tickets[base + e]
            if t is not None:
                if not t.done():
                    mover.promote(t)  # a prefetch still queued is needed now (the late prefetch)
                    self.stall_s += mover.wait(t)
                elif t.error is not None:
                    mover.wait(t)
                tickets[base + e] = None
            if up[e] is None and self.at[base + e] >= 0 and self.prec_of[base + e] == "native":  # moved since placed
                self._place(base + e, layer, e, self.pools[self.pool_index[layer]], self.at[base + e], "native")
            if up[e] is None:
                raise RuntimeError(f"execution=offload: MoE layer {layer} (model.layers.{self.stack.moe_ids[layer]}) "
                                   f"expert {e} runs but is neither in the arena "
                                   f"nor staged (the arena and the engine disagree)")
        for e in host:  # miss=cpu_compute: the expert runs from host memory, never copied to the device
            views = self._host_views(layer, e)
            for n in self.names:
                src[n][e] = views[n]
            self.host_runs += 1
        out = run_experts(mod.inner, hidden, index, weights, src)
        for e in host:
            for n in self.names:
                src[n][e] = None
        if low:
            for e in low:
                for n in self.names:
                    src[n][e] = None
        for i, (lay, e, _, raw) in enumerate(self._staged):
            s = self.sources[lay]
            if raw is None and s[self.up][e] is self.staging[i][1][self.up]:  # still the staging view
                for n in self.names:
                    s[n][e] = None
        self._staged.clear()
        if self.params.check:
            self.check_residency()
        return out

    def _host_views(self, layer: int, expert: int) -> dict:
        if self.tier.name == "ram" and self._device.type == "cpu":
            return self.tier.host_views(layer, expert)
        views = self._views_at(torch.empty(self.slot_bytes, dtype=torch.uint8), 0)
        self.tier.copy_into(layer, expert, views)
        if self._device.type != "cpu":  # the kernel runs on the device's stream; the weights stay host-side
            views = {n: v.to(self._device) for n, v in views.items()}
        return views

    def _views_at(self, buf: torch.Tensor, offset: int, layout=None) -> dict:
        """Views of one copy at ``offset`` of ``buf``: each tensor of ``layout`` (default: the native
        parameters) and ``BYTES``, the whole copy (one memmove or copy fills it)."""
        from .tiers import BYTES, words

        out, o = {}, offset
        for n, dtype, shape, nbytes in layout or self._native_layout:
            out[n] = buf[o:o + nbytes].view(dtype).view(shape)
            o += nbytes
        out[BYTES] = words(buf[offset:o])
        return out

    def _raw_at(self, buf: torch.Tensor, offset: int, layer: int, precision: str) -> dict:
        """:meth:`_views_at` for a ``precision`` copy (:meth:`ExpertStore.raw`'s tensors; a native copy: its
        parameters), remembered per (buffer, offset, layout): making them is up to 18 tensor calls (30-40 us,
        most of a mixed arena's insert), and copies keep landing at the same offsets (sizes repeat). At most
        8192 remembered (then forgotten at once)."""
        layout = self._native_layout if precision == "native" else self._raw_layout[layer, precision]
        key = (buf.data_ptr(), offset, id(layout))
        out = self._raw_cache.get(key)
        if out is None:
            if len(self._raw_cache) >= 8192:
                self._raw_cache.clear()
            out = self._raw_cache[key] = self._views_at(buf, offset, layout)
        return out

    # ---- checks and results -------------------------------------------------------------------------------
    def check_residency(self, contents: bool = True) -> None:
        """The arena holds exactly the engine's resident set (every entry has its bytes at its precision, no
        range is held for an expert the engine does not have, used bytes equal each pool's) and, with
        ``contents``, each copy's bytes are its expert's (arrived copies, compared with the host tier)."""
        cache = self.stack.cache
        held = {k for k, o in enumerate(self.at) if o >= 0}
        resident = cache.entries  # (a new dict per read)
        entries = set(resident)
        if held != entries:
            raise AssertionError(f"arena holds {sorted(held - entries)[:8]} the engine does not; engine holds "
                                 f"{sorted(entries - held)[:8]} the arena does not")
        for key in held:
            if self.prec_of[key] != resident[key].precision:
                raise AssertionError(f"key {key}: the arena holds {self.prec_of[key]}, the engine "
                                     f"{resident[key].precision}")
        for pi, pool in enumerate(cache.pools):
            arena = self.pools[pi]
            if arena.used > pool.capacity:
                raise AssertionError(f"pool {pi}: {arena.used} bytes exceed {pool.capacity}")
            if arena.used != pool.used:
                raise AssertionError(f"pool {pi}: arena uses {arena.used} bytes, engine {pool.used}")
            spans = sorted(arena.live.values()) + arena.holes()
            spans.sort()
            if any(a[0] + a[1] > b[0] for a, b in zip(spans, spans[1:])):
                raise AssertionError(f"pool {pi}: overlapping ranges {spans[:8]}")
        if contents:
            store = self.stack.store
            for key in held:
                t = self.tickets[key]
                if t is not None and not t.done():
                    continue
                layer, e = divmod(key, self.E)
                arena, prec = self.pools[self.pool_index[layer]], self.prec_of[key]
                if prec == "native":
                    views = self._views_at(arena.buf, self.at[key])
                    want = self._views_at(torch.empty(self.slot_bytes, dtype=torch.uint8), 0)
                    self.tier.copy_into(layer, e, want)
                else:
                    views = self.raw_views.get(key) or self._raw_at(arena.buf, self.at[key], layer, prec)
                    want = store.raw(layer, e, prec)
                for n in want:
                    if n in views and not torch.equal(views[n].cpu(), want[n]):
                        raise AssertionError(f"slot of layer {layer} expert {e} does not hold its bytes ({n})")

    def wall(self) -> dict:
        out = super().wall()
        m = self.mover
        out.update({
            "transfers": m.transfers,
            "bytes_moved": m.bytes_moved,
            "transfer_s": m.busy_s,  # the channel busy, throttle pacing included
            "copy_s": m.copy_s,  # the copies themselves
            "achieved_gbps": m.bytes_moved / m.busy_s / 1e9 if m.busy_s > 0 else None,
            "copy_gbps": m.bytes_moved / m.copy_s / 1e9 if m.copy_s > 0 else None,
            "throttled": bool(self.params.throttle),
            "host_computed_experts": self.host_runs,
            "low_precision_runs": self.low_runs,  # experts run from a stored low-precision copy's bytes
        })
        return out

    def memory(self) -> dict:
        out = super().memory()
        out.update({
            "arena_capacity_bytes": self.capacity_bytes,
            "arena_slots": sum(len(a.slots) for a in self.pools),  # native one-expert slots
            "arena_layout": "mixed" if self.pools and self.pools[0].mixed else "uniform",
            "arena_compactions": sum(a.compactions for a in self.pools),
            "arena_bytes_compacted": sum(a.bytes_compacted for a in self.pools),
            "slot_bytes": self.slot_bytes,
            "arena_peak_bytes": self.peak_bytes,
            "staging_peak_bytes": len(self.staging) * self.slot_bytes,
            "dense_device_bytes": self.stack.dense_bytes,
            **self.tier.describe(),
        })
        return out

    def close(self) -> None:
        m = getattr(self, "mover", None)
        if m is not None:
            m.close()
        tier = getattr(self, "tier", None)
        if tier is not None:
            tier.close()
