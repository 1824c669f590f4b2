"""``execution=offload``: the device holds the dense weights and one pre-allocated expert arena of exactly the
configured capacity; expert weights live only in a host tier (:mod:`.tiers`); every decision of the cache
manager is carried out for real (Fiddler's pre-allocated slots and transfer stream, SpecMD's watchdog
thread).

The executor is composed of named parts, each in its own module, and adds only their wiring:

* the **host tier** (:mod:`.tiers`): ``ram`` (pinned on CUDA) or ``disk`` (the checkpoint, read per expert);
* the **mover** (:mod:`.transfer`): one channel of copy jobs, demand before prefetch, paced to the profile's
  link (a transfer thread on the CPU; a side stream and events on CUDA);
* the **occupancy** (:mod:`.occupancy`): the engine's residency events carried out in the arena (slots,
  tickets, compaction, stream staging rows, copy jobs), and the **placement** (:mod:`.placement`), which
  extends it with each layer call's layout: the *prepare* (:meth:`~.placement.Placement.plan_call`) and
  *finalize* around the experts;
* the **kernel** (:mod:`.kernel`): the layer call's experts as one grouped GEMM per projection over the
  arena's ``[slots, ...]`` tensors, expert ids mapped to slot ids.

Per MoE layer call (:meth:`Offload.run`):

1. the experts that run on the device, those computed from the host tier and those at a stored precision
   come from the engine's plan (lossless calls: the experts the selection requests, read on the host once);
2. **prepare** (``plan_call``): staged and unpacked copies are put in place, the expert map is uploaded,
   and each bank (the arena, the two stream banks of the double buffer, the work bank, the host tier)
   learns which copies it waits for;
3. **experts**: :func:`~.kernel.grouped_experts` over the banks, each bank's copies acquired just before
   it computes (a queued prefetch is promoted: the late prefetch), so the arena's experts compute while
   streamed ones are still arriving and nothing waits for what it does not need;
4. **finalize**: the call's staging is released; with ``execution.check=true`` the arena is asserted to hold
   exactly the engine's resident set, byte for byte.

The executor decides nothing. Stored low-precision copies (``miss=fetch_lowest_bit``, ``fetch_priority``, ...)
move as their own bytes -- bit-packed weights, fp16 scale and zero (:meth:`~specmd.quant.base.ExpertStore.raw`),
never dequantized floats -- into byte ranges of a mixed arena (:class:`~.arena.ByteArena`), and are unpacked
by the store's own function when they run, so their outputs are the simulated run's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

from ..engine.link import link_rate
from ..errors import ConfigError
from ..accel import accel_for
from ..machine import CorePlan
from .base import EXECUTION, Executor, RunFacts, full_selection, steady_host_allocator, upload
from .kernel import expert_tensors, grouped_experts
from .hostwork import HOST_COMPUTE
from .placement import Placement
from .transfer import make_mover

HOSTS = ("ram", "disk")
PAGE_CACHE = ("drop", "keep")
KERNELS = ("auto", "grouped", "looped")


@dataclass
class OffloadParams:
    host: str = "ram"  # ram: experts in host memory (pinned on CUDA); disk: read per expert from the checkpoint
    throttle: bool = True  # pace transfers to the profile's link (its rate at the model's expert size: the clock's) + latency_us (false: the machine's speed)
    page_cache: str = "drop"  # disk: drop each read's pages from the page cache (every fetch reads the disk) | keep
    check: bool = False  # after every layer call, assert the arena equals the engine's resident set (tests)
    # how a bank's experts run: grouped (one grouped GEMM per projection: a GPU, where launches and the
    # host's work cost) | looped (one GEMM per group: a CPU, where an empty group of a grouped call costs and
    # a launch does not) | auto (grouped on CUDA with bf16 experts, looped elsewhere: torch's CUDA
    # grouped_mm is native for bf16 only, and for other dtypes loops with a read of the offsets to the host,
    # two synchronisations per bank and call). Same bits either way (tests).
    kernel: str = "auto"
    # where experts the miss policy sends to the host run (cpu_compute, hybrid): thread (a worker thread
    # beside the device: a GPU's host CPU) | inline (the compute thread, first in the layer call while its
    # copies land: a CPU device, whose host is the device) | auto (thread on CUDA, inline elsewhere).
    # Same bits either way on a CPU (tests)
    host_compute: str = "auto"
    # the run's CPU threads (issue 56; :class:`specmd.machine.CorePlan`): intra-op threads of the compute thread
    # (auto: the job's cores minus one for the copy thread and minus the host lane's), of the host lane when it is
    # a thread of its own (host_compute=thread; auto: half of what the copy thread leaves), and whether each
    # role is pinned to its own cores of the affinity mask. Recorded in provenance.machine.placement; a CPU
    # GEMM's last bits depend on its thread count, so offload equals simulated bit for bit at equal threads
    threads: Union[int, str] = "auto"
    host_threads: Union[int, str] = "auto"
    pin: bool = False

    def __post_init__(self):
        from ..machine import threads_error

        for key in ("threads", "host_threads"):
            why = threads_error(getattr(self, key), key)
            if why:
                raise ValueError(why)
        if self.host not in HOSTS:
            raise ValueError(f"host={self.host!r}; valid choices: {', '.join(HOSTS)}")
        if self.page_cache not in PAGE_CACHE:
            raise ValueError(f"page_cache={self.page_cache!r}; valid choices: {', '.join(PAGE_CACHE)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}; valid choices: {', '.join(KERNELS)}")
        if self.host_compute not in ("auto", *HOST_COMPUTE):
            raise ValueError(f"host_compute={self.host_compute!r}; valid choices: auto, {', '.join(HOST_COMPUTE)}")


class Offload(Executor):
    name = "offload"

    device_experts = False
    timed = True

    Params = OffloadParams

    # ---- before any model work: what this executor cannot carry out, and how the model must load --------
    @classmethod
    def config_errors(cls, params, run: RunFacts) -> list[str]:
        errors = []
        if run.replay:
            errors.append("execution=offload runs a model, and replay.trace replays a trace without one: drop one "
                          "of them")
        if not run.stack_enabled:
            errors.append("execution=offload needs the policy stack (stack.enabled=false runs the unhooked model)")
        if run.timing_as:
            errors.append(f"execution=offload moves this model's own bytes; hardware.timing_as={run.timing_as} "
                          f"times another model's: drop one of them")
        mcls, mparams = run.miss
        lossy = [p for p in mcls.required_precisions(mparams) if p != "native"]
        if params.host == "disk" and (lossy or getattr(mparams, "precision", "native") not in (None, "native")):
            errors.append(f"execution.host=disk reads native experts from the checkpoint, and miss={mcls.name} "
                          f"fetches {lossy} copies, which are quantized from the experts' weights in host memory: "
                          f"use execution.host=ram for this stack")
        if params.host == "disk":
            if run.checkpoint is None:
                errors.append(f"execution.host=disk reads experts from a local checkpoint's safetensors, and "
                              f"model={run.model_name} has none (model.pretrained={run.pretrained}): use a local "
                              f"directory or specmd:<name>, or execution.host=ram")
        elif "page_cache" in run.explicit and params.page_cache != "drop":
            errors.append(f"execution.page_cache={params.page_cache} applies to execution.host=disk, and host=ram")
        errors += _auto_capacity_errors(run)
        if run.layer_budget != "uniform":
            errors.append(f"execution=offload allocates each layer's arena once, and hardware.layer_budget="
                          f"{run.layer_budget} resizes the layers' pools after the warm-up: use layer_budget=uniform "
                          f"(or execution=simulated, replay)")
        errors += _thread_errors(params, run)
        if not (run.device == "cpu" or run.device.startswith("cuda")):
            errors.append(f"execution=offload runs on device=cpu or cuda[:N], not device={run.device}")
        return errors

    @classmethod
    def experts_on_meta(cls, params) -> bool:
        return params.host == "disk"  # the disk tier reads them from the checkpoint: never materialised

    # ---- set-up: tier, mover, placement ---------------------------------------------------------------
    def attach(self, stack) -> None:
        """Wire the named parts (module docstring) over the installed stack. Every check that needs no loaded
        model is :meth:`config_errors`' (before any model work); what is refused here needs the model's
        experts: their bytes against the engine's, and the stored copies' raw bytes (:func:`_low_tiers`,
        :func:`_alignment`)."""
        super().attach(stack)
        self.pad_host_runs = 0  # experts computed from the host tier for a batch's pad rows only (_pad_only)
        steady_host_allocator()  # what it measures is the steady state, not a fresh process's page faults
        p = self.params
        geom, store = stack.geom, stack.store
        self.E = E = geom.num_experts
        self._device = dev = stack.device
        tensors = [expert_tensors(m, E) for m in stack.expert_modules]
        shapes = {n: tuple(t.shape[1:]) for n, t in tensors[0].items()}
        dtype = next(iter(tensors[0].values())).dtype
        _check_native_bytes(shapes, dtype, store)
        self.tier = self._host_tier(stack, tensors, shapes, dtype)
        accel = accel_for(dev)
        low_tiers, raw_layout = _low_tiers(store, geom.num_layers, E, accel)
        tiers = {"native": self.tier, **low_tiers}
        align = _alignment(dtype, store, raw_layout)
        how = host_compute(p, accel is not None)
        mcls, mparams = stack.spec.miss
        self.thread_plan = plan = CorePlan.plan(p.threads, p.host_threads, p.pin, copy_thread=True,
                                                host_lane=how == "thread" and mcls.computes_on_host(mparams))
        self._undo_threads = plan.enter()
        self.mover = _mover(stack.spec.hardware, geom.expert_bytes, p.throttle, dev, plan)
        self.host_worker = HOST_COMPUTE[how](plan)
        looped = p.kernel == "looped" or p.kernel == "auto" and not (dev.type == "cuda" and dtype == torch.bfloat16)
        self.placement = Placement(stack.cache.layout(), shapes, dtype, dev, tiers, self.mover, dict(store.bytes_of),
                                   store, self._name, mixed=len(tiers) > 1, raw_layout=raw_layout, align=align,
                                   looped=looped, host_worker=self.host_worker, identity=geom.identity_experts)
        self.identity_from = E if geom.identity_experts else None  # ids from E on: identity experts
        stack.cache.subscribe(self.placement)

    def _host_tier(self, stack, tensors: list, shapes: dict, dtype: torch.dtype):
        """The native copies' host tier: the experts' own tensors in host memory (``ram``, pinned on CUDA), or
        the checkpoint's safetensors read per expert (``disk``: config_errors made sure there is one)."""
        from .tiers import DiskTier, RamTier

        dev = stack.device
        if self.params.host == "ram":
            return RamTier(tensors, accel_for(dev))
        if stack.checkpoint is None:  # (a stack installed directly, without the run's config_errors)
            raise ConfigError("execution.host=disk reads experts from a local checkpoint's safetensors: install the "
                              "stack with checkpoint=<its directory>, or use execution.host=ram")
        return DiskTier(stack.checkpoint, list(stack.geom.layer_ids), shapes, dtype, stack.geom.num_experts,
                        stack.adapter.hub_layout(), self.params.page_cache, dev)

    def _name(self, layer: int, expert: int) -> str:
        return f"model.layers.{self.stack.moe_ids[layer]} expert {expert}"

    # ---- one layer call ---------------------------------------------------------------------------------
    def run(self, mod, hidden, index, weights, plan, rec=None):
        """1-4 of the module docstring. ``index``/``weights``: what the block passes (on the device); ``rec``:
        the layer call's record (the selection on the host); ``plan``: the engine's Execution, or None (every
        requested expert runs, native, on the device)."""
        place = self.placement
        if plan is None:  # 1
            host, low, all_run = (), None, self.identity_from is None  # (identity rows are in no bank)
            sel = rec.block_index  # the selection the block passed instead of its router's (no family does)
            if sel is None:
                running, sel = rec.requested(self.E), rec.index
            else:
                running = torch.unique(sel).tolist()
            if rec.live is not None:  # pad rows: computed only with experts that run anyway (full_selection)
                sel, all_run = rec.full_index, False
        else:
            emap = plan.expert_map.numpy()  # [E] host
            running = (emap >= 0).nonzero()[0].tolist()
            host, low, all_run = plan.host, plan.precisions, False
            sel, w = full_selection(rec, plan.index, plan.weights)
            index, weights = upload(sel, self._device), upload(w, self._device)
        pads = self._pad_only(rec, sel, running, host) if rec is not None and rec.live is not None else ()
        if pads:  # pad rows' experts that run for no live row: from the host tier, as the model computes them
            host = (*host, *pads)
        call = place.plan_call(mod.layer, running, host, low, sel, all_run)  # 2
        place.host_runs -= len(pads)  # (not the engine's host computes)
        self.pad_host_runs += len(pads)
        if call.banks and (call.groups is None or call.groups):
            out = grouped_experts(mod.inner, self.stack.adapter.experts_layout, hidden, index, weights, call.slot_of,
                                  call.banks, call.rows, place.ready, call.groups, self.identity_from)  # 3
        else:  # nothing runs here (every expert dropped)
            out = torch.zeros_like(hidden)
        place.finalize()  # 4
        if self.params.check:
            self.check_residency()
        return out

    def _pad_only(self, rec, sel, running, host) -> list:
        """The experts that only a batch's pad or finished rows select (``sel``: the whole ``[T, k]`` selection
        on the host; ``rec.live``: the live rows). They are no requests: the engine neither counts nor
        fetches them. The call computes them from the host tier (in place on a CPU; on a GPU through the
        work bank, bytes the engine does not count) so that every pad row is computed as the model computes
        it: a live row shares each expert's GEMM with the pad rows that select that expert, and a GEMM's
        row results depend in their last bits on its row count, so a pad row computed otherwise at one
        layer routes elsewhere at the next and moves a live row's bits (measured on GPT-OSS at batch 4).
        :func:`~.base.full_selection` says why pad outputs are harmless either way."""
        pad = torch.ones(sel.shape[0], dtype=torch.bool)
        pad[rec.live] = False
        wanted = [e for e in torch.unique(sel[pad]).tolist() if e < self.E]  # (an identity expert: nothing to run)
        if not wanted:
            return []
        have = set(running)
        have.update(host)
        return [e for e in wanted if e not in have]

    # ---- checks and results -------------------------------------------------------------------------------
    def check_residency(self, contents: bool = True) -> None:
        """The arena holds exactly the engine's resident set, byte for byte (:meth:`~.occupancy.ArenaOccupancy.
        check`): the cache manager read as the seam's :class:`~specmd.engine.events.ResidentSet`, its only
        read of the manager beside the pool layout and the events."""
        self.placement.check(self.stack.cache, contents)

    def stalled(self) -> float:
        return self.placement.stall_s

    def moved(self) -> int:
        return self.placement.bytes_submitted

    def wall(self) -> dict:
        out = super().wall()
        m, place = self.mover, self.placement
        settle = getattr(m, "settle", None)
        if settle is not None:  # CUDA: the copies' own time, from their events
            settle()
        busy = m.busy_s if self.params.throttle or settle is None else m.copy_s  # (unthrottled CUDA: issue time)
        out.update({
            "transfers": m.transfers,
            "bytes_moved": m.bytes_moved,
            "transfer_s": busy,  # the channel busy, throttle pacing included
            "copy_s": m.copy_s,  # the copies themselves
            "achieved_gbps": m.bytes_moved / busy / 1e9 if busy > 0 else None,
            "copy_gbps": m.bytes_moved / m.copy_s / 1e9 if m.copy_s > 0 else None,
            "throttled": bool(self.params.throttle),
            "host_computed_experts": place.host_runs,
            "pad_host_experts": self.pad_host_runs,  # pad rows' own experts, computed as the model does
            "host_s": self.host_worker.busy_s,  # the host computing experts (execution.host_compute)
            "low_precision_runs": place.low_runs,  # experts run from a stored low-precision copy's bytes
        })
        return out

    def memory(self) -> dict:
        out = super().memory()
        out.update(self.placement.memory())
        out.update({"dense_device_bytes": self.stack.dense_bytes, **self.tier.describe()})
        return out

    def close(self) -> None:
        m = getattr(self, "mover", None)
        if m is not None:
            m.close()
        worker = getattr(self, "host_worker", None)
        if worker is not None:
            worker.close()
        tier = getattr(self, "tier", None)
        if tier is not None:
            tier.close()
        undo = getattr(self, "_undo_threads", None)
        if undo is not None:  # (the process's threads and masks as they were: the next install plans its own)
            self._undo_threads = None
            undo()


def host_compute(params: OffloadParams, accelerated: bool) -> str:
    """Where the host's experts run: ``execution.host_compute``, auto resolved (a thread beside a GPU --
    ``accelerated``: the device has an :class:`~specmd.accel.Accel` --; inline on a CPU device, whose host is
    the device)."""
    return params.host_compute if params.host_compute != "auto" else "thread" if accelerated else "inline"


def _auto_capacity_errors(run: RunFacts) -> list:
    """``hardware.capacity=auto``: the device's free memory, read where it can be (CUDA, or its stand-in); on a
    CPU device there is none to read and ``hardware.memory_gb`` is required; a readable one takes no memory_gb
    beside it."""
    if run.capacity != "auto":
        return []
    readable = accel_for(torch.device(run.device)) is not None
    if not readable and run.memory_gb is None:
        return [f"hardware.capacity=auto on device={run.device}: there is no device memory to read; set "
                f"hardware.memory_gb (the memory the emulated device has, GiB)"]
    if readable and run.memory_gb is not None:
        return [f"hardware.capacity=auto reads device={run.device}'s free memory, and hardware.memory_gb="
                f"{run.memory_gb:g} sets it: set one of them"]
    return []


def _thread_errors(params: OffloadParams, run: RunFacts) -> list[str]:
    """What the thread settings cannot do in ``run``: pin without Linux's affinity calls, or host threads for
    a host lane that is no thread of its own."""
    from ..machine import can_pin

    errors = []
    if params.pin and not can_pin():
        errors.append("execution.pin=true needs Linux's sched_setaffinity (and /proc/self/task), which this "
                      "platform lacks: leave execution.pin=false")
    if "host_threads" in run.explicit and params.host_threads != "auto":
        how = host_compute(params, accel_for(run.device) is not None)
        mcls, mparams = run.miss
        if how != "thread":
            errors.append(f"execution.host_threads={params.host_threads} sets the host lane's threads when it is a "
                          f"thread of its own (execution.host_compute=thread; auto is inline on a CPU device, "
                          f"where the host's experts run on the compute thread's execution.threads)")
        elif not mcls.computes_on_host(mparams):
            errors.append(f"execution.host_threads={params.host_threads}: miss={mcls.name} computes no expert on the "
                          f"host (cpu_compute and hybrid do)")
    return errors


def _check_native_bytes(shapes: dict, dtype: torch.dtype, store) -> None:
    """One expert's bytes in the model's tensors are the engine's (they differ only for another model's sizes,
    which config_errors refused first: hardware.timing_as)."""
    slot_bytes = sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
    if slot_bytes != store.bytes_of["native"]:
        raise ConfigError(f"execution=offload: one expert is {slot_bytes} bytes in its tensors but the "
                          f"engine counts {store.bytes_of['native']} (hardware.timing_as cannot be offloaded)")


def _low_tiers(store, num_layers: int, num_experts: int, accel) -> tuple[dict, dict]:
    """The stored low-precision copies' host tiers (precision -> tier: their raw bytes, per layer as ``[E, ...]``
    tensors in host memory) and their raw layouts ((layer, precision) -> ``[(name, dtype, shape, bytes)]``,
    equal ones shared); none without stored copies."""
    tiers: dict = {}
    raw_layout: dict = {}
    low = [q for q in store.precisions if q != "native"]
    if low and not store.packable:
        raise ConfigError(f"execution=offload: the store's {', '.join(low)} copies have no raw bytes to move "
                          f"(quant method without ExpertStore.raw)")
    from .tiers import RamTier

    for q in low:
        rows = []
        for layer in range(num_layers):
            raws = [store.raw(layer, e, q) for e in range(num_experts)]
            lay = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in raws[0].items()]
            raw_layout[layer, q] = next((v for v in raw_layout.values() if v == lay), lay)
            rows.append({n: torch.stack([r[n] for r in raws]) for n in raws[0]})
        tiers[q] = RamTier(rows, accel)
        if set(tiers[q].row_bytes) != {store.bytes_of[q]}:
            raise RuntimeError(f"execution=offload: {q} copies pack to {sorted(set(tiers[q].row_bytes))} "
                               f"bytes, the engine counts {store.bytes_of[q]}")
    return tiers, raw_layout


def _alignment(dtype: torch.dtype, store, raw_layout: dict) -> int:
    """The byte alignment of a mixed arena's copies: the widest element any copy holds. Copies of several
    sizes share a byte arena, so every size must keep the next copy aligned, and every raw tensor its own."""
    align = max([dtype.itemsize] + [d.itemsize for lay in raw_layout.values() for _, d, _, _ in lay])
    if not raw_layout:  # no stored copies: one size, native, nothing shares
        return align
    for q, n in store.bytes_of.items():
        if n % align:
            raise ConfigError(f"execution=offload: a {q} copy is {n} bytes, not a multiple of {align} (the "
                              f"widest element its arena neighbours hold), so copies of several precisions "
                              f"cannot share a pool; fetch one precision, or use execution=simulated")
    for (layer, q), lay in raw_layout.items():
        o = 0
        for n, d, _, nb in lay:
            if o % d.itemsize:
                raise ConfigError(f"execution=offload: {q} copy's {n} starts at byte {o}, not aligned to its {d}")
            o += nb
    return align


def _mover(hw, expert_bytes: int, throttle: bool, dev: torch.device, plan=None):
    """The channel of copy jobs, paced to the profile's link at the model's expert size (the simulated clock's
    channel's) plus its latency, or unpaced (``throttle`` false): a side stream and events on CUDA, a
    transfer thread elsewhere."""
    bw = link_rate(hw, expert_bytes) if throttle else None
    lat = hw.latency_us * 1e-6 if throttle else 0.0
    return make_mover(dev, bw, lat, plan)


EXECUTION.register(Offload)
