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
Native-precision experts are moved; fetching stored low-precision copies is rejected at config time.
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
        if self.slot_bytes != stack.store.bytes_of["native"]:
            raise ConfigError(f"execution=offload: one expert is {self.slot_bytes} bytes in its tensors but the "
                              f"engine counts {stack.store.bytes_of['native']} (hardware.timing_as cannot be offloaded)")
        # the host tier
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
        # the arena: one buffer per pool, exactly its capacity, cut into slots of one expert
        self._shapes = shapes
        self.pool_index = [cache.pools.index(pool) for pool in cache._pool_of_layer]
        self.arenas, self.slot_views, self.free = [], [], []
        for pool in cache.pools:
            # zeroed: the pages are touched now, not by the first fetch into each slot (on a CPU device first-touch
            # page faults made the first pass's copies 3-10x slower than later ones)
            buf = torch.zeros(pool.capacity, dtype=torch.uint8, device=dev)
            self.arenas.append(buf)
            views = [self._views_at(buf, s * self.slot_bytes) for s in range(pool.capacity // self.slot_bytes)]
            self.slot_views.append(views)
            self.free.append(list(range(len(views) - 1, -1, -1)))
        self.capacity_bytes = sum(b.numel() for b in self.arenas)
        self.used = [0] * len(self.arenas)
        self.peak_slots = 0
        self.staging: list[dict] = []  # slots for streamed experts (grow only; reported)
        self._staged: list = []  # (layer, expert, ticket) of this layer call
        self._batch: list = []  # this layer call's demand copies not yet submitted: (layer, expert, slot views)
        self._batch_keys: list = []  # their cache keys (-1: streamed)
        self.slot_of = [-1] * (L * E)
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
        cache.events = self

    # ---- events from the cache manager ------------------------------------------------------------------
    def inserted(self, key: int, layer: int, precision: str, prefetched: bool) -> None:
        pi = self.pool_index[layer]
        free = self.free[pi]
        e = key - layer * self.E
        if not free:
            raise RuntimeError(f"execution=offload: pool {pi} has no free slot for MoE layer {layer} (model.layers."
                               f"{self.stack.moe_ids[layer]}) expert {e}, but the "
                               f"engine admitted it (the arena and the engine disagree)")
        slot = free.pop()
        views = self.slot_views[pi][slot]
        self.slot_of[key] = slot
        src = self.sources[layer]
        for n in self.names:
            src[n][e] = views[n]
        self.used[pi] += 1
        used = sum(self.used)
        if used > self.peak_slots:
            self.peak_slots = used
        self.copies += 1
        if not prefetched:  # a demand fetch: batched with the call's others
            self._batch.append((layer, e, views))
            self._batch_keys.append(key)
            return
        self._flush()  # the call's demand copies go first, as the engine issued them
        self.tickets[key] = self.mover.submit(partial(self.tier.copy_into, layer, e, views), self.slot_bytes,
                                              False, self._name(layer, e))

    def _flush(self) -> None:
        """Submit the layer call's pending demand copies as one channel job (paced as that many transfers)."""
        items = self._batch
        if not items:
            return
        t = self.mover.submit(partial(self.tier.copy_many, items, self._name), self.slot_bytes * len(items), True,
                              self._name(items[0][0], items[0][1]) + (f" and {len(items) - 1} more" if len(items) > 1
                                                                       else ""), len(items))
        tickets = self.tickets
        for key in self._batch_keys:
            if key >= 0:
                tickets[key] = t
        if self._staged:
            self._staged = [(lay, e, t if tk is None else tk) for lay, e, tk in self._staged]
        self._batch, self._batch_keys = [], []

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
        slot = self.slot_of[key]
        self.slot_of[key] = -1
        layer, e = divmod(key, self.E)
        pi = self.pool_index[layer]
        self.free[pi].append(slot)
        self.used[pi] -= 1
        src = self.sources[layer]
        for n in self.names:
            src[n][e] = None

    def streamed(self, layer: int, expert: int, precision: str) -> None:
        i = len(self._staged)
        if i == len(self.staging):  # grows to the most experts one call streamed (memory.staging_peak_bytes)
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self._device)
            self.staging.append(self._views_at(buf, 0))
        views = self.staging[i]
        self._batch.append((layer, expert, views))
        self._batch_keys.append(-1)
        self._staged.append((layer, expert, None))  # its ticket: the batch's, at submission
        src = self.sources[layer]
        for n in self.names:
            src[n][expert] = views[n]
        self.copies += 1

    # ---- one layer call ---------------------------------------------------------------------------------
    def run(self, mod, hidden, index, weights, plan):
        layer = mod.layer
        E = self.E
        host = ()
        if plan is not None:
            index, weights = plan.index, plan.weights
            host = plan.host
            emap = plan.expert_map.tolist()
            running = [e for e in range(E) if emap[e] >= 0]
        else:
            running = torch.bincount(index.reshape(-1), minlength=E).nonzero().squeeze(1).tolist()
        base = layer * E
        self._flush()
        mover, tickets = self.mover, self.tickets
        for _, _, t in self._staged:
            if not t.done():
                self.stall_s += mover.wait(t)
            elif t.error is not None:
                mover.wait(t)  # raises, naming the expert
        src = self.sources[layer]
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
        for i, (lay, e, _) in enumerate(self._staged):
            s = self.sources[lay]
            if s[self.up][e] is self.staging[i][self.up]:  # still the staging view (not since inserted)
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

    def _views_at(self, buf: torch.Tensor, offset: int) -> dict:
        from .tiers import BYTES, words

        out, o = {}, offset
        for n, shape in self._shapes.items():
            nbytes = math.prod(shape) * self.dtype.itemsize
            out[n] = buf[o:o + nbytes].view(self.dtype).view(shape)
            o += nbytes
        out[BYTES] = words(buf[offset:offset + self.slot_bytes])  # the whole slot: one copy fills it (RamTier)
        return out

    # ---- checks and results -------------------------------------------------------------------------------
    def check_residency(self, contents: bool = True) -> None:
        """The arena holds exactly the engine's resident set (every entry has a slot, no slot is held for an
        expert the engine does not have, used bytes within each pool's capacity) and, with ``contents``, each
        slot's bytes are its expert's (arrived copies, compared with the host tier)."""
        cache = self.stack.cache
        held = {k for k, s in enumerate(self.slot_of) if s >= 0}
        entries = set(cache.entries)
        if held != entries:
            raise AssertionError(f"arena holds {sorted(held - entries)[:8]} the engine does not; engine holds "
                                 f"{sorted(entries - held)[:8]} the arena does not")
        for pi, pool in enumerate(cache.pools):
            if self.used[pi] * self.slot_bytes > pool.capacity:
                raise AssertionError(f"pool {pi}: {self.used[pi]} slots exceed {pool.capacity} bytes")
            if self.used[pi] * self.slot_bytes != pool.used:
                raise AssertionError(f"pool {pi}: arena uses {self.used[pi] * self.slot_bytes} bytes, engine {pool.used}")
        if contents:
            for key in held:
                t = self.tickets[key]
                if t is not None and not t.done():
                    continue
                layer, e = divmod(key, self.E)
                pi = self.pool_index[layer]
                views = self.slot_views[pi][self.slot_of[key]]
                want = self._views_at(torch.empty(self.slot_bytes, dtype=torch.uint8), 0)
                self.tier.copy_into(layer, e, want)
                for n in self.names:
                    if not torch.equal(views[n].cpu(), want[n]):
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
        })
        return out

    def memory(self) -> dict:
        out = super().memory()
        out.update({
            "arena_capacity_bytes": self.capacity_bytes,
            "arena_slots": sum(len(v) for v in self.slot_views),
            "slot_bytes": self.slot_bytes,
            "arena_peak_bytes": self.peak_slots * self.slot_bytes,
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
