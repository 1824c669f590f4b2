"""The deterministic simulated clock (:class:`SimClock`, the interface it implements:
:class:`~specmd.engine.clock.Clock`) and its device model, the roofline (:class:`Roofline`, :func:`one_row`).

:class:`SimClock` has one non-preemptive transfer channel (:mod:`specmd.engine.link`: demand before queued
prefetches) and a roofline per op: its handles are :class:`~specmd.engine.link.Transfer` objects whose
arithmetic stays inside it (a demand fetch needs none: the clock keeps the
latest one's completion and the next ``wait`` includes it). ``execution=offload`` keeps the simulated
clock deciding (so residency, victims and outputs are those of ``execution=simulated``, bit for bit -- on a
CUDA device but for experts a miss policy sends to the host, which the CPU computes with its own bits) and
measures the same passes on the wall (the executor's pass timer and transfer tickets): a clock on real
time would make the decisions depend on the machine's timing.

**The host beside the device** (:class:`SimClock`'s ``overlap``, ``contention`` and ``host``).

``overlap`` (``hardware.host_overlap``): whether the host is a processor of its own. False (a CPU, where
the host *is* the device): every overhead adds to the device's compute, in order, and experts computed
on the host run on the same cores -- beside the link, but before the device's experts. True (a GPU): the host
queues kernels ahead of the device, so between two synchronisations the host's overheads (per decoder
layer, per expert, per copy job issued, per prediction, per token) and the device's compute run side
by side and the segment takes the longer of the two; the model synchronises once per MoE layer call
(the read-back of its routing, :mod:`specmd.hook.readback`: the cache needs the selection on the
host), once per pass (the logits) and wherever compute waits for a transfer or the host. The
policies' decisions (``decision``) run after the read-back with the device idle: serial either way.

``contention`` (``hardware.host_link_contention``): host work and the link's copies running at once
share host memory (and on a CPU its cores): the overlapped span costs this fraction of itself more,
charged to whichever of the two ends last (0: each runs as if alone; 1: they take turns). Host work
is what the host computes (``host``) and, without ``overlap`` (a CPU device), all compute. ``specmd
calibrate`` measures a kernel and copies alone and together.

The host is a resource of its own beside the link (``host``): work a miss policy sends there starts
when the host is free and runs beside the link; with ``overlap`` also beside the device's compute of
the layer's other experts, and the layer's output waits for it after the device's experts: Zhu et al.'s SMoE pipeline
(importance-driven scheduling, Fig. 9) runs "CPU expert computation: CPU computes the parameters of
experts from layer X not in GPU" beside "Direct expert computation: ... experts that are already in
the GPU", and "while the CPU computes one expert (E2), another (E0) can be simultaneously loaded into
GPU memory via PCIe" (§II).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from .clock import Clock
from .link import TransferChannel, link_rate


@dataclass(frozen=True)
class Roofline:
    """time(op) = max(flops / peak, bytes / memory bandwidth) + serial * min(...): ``serial`` 0 is the ideal
    roofline (a GPU streams weights while it multiplies); 1 adds the two (a CPU's small GEMMs: ``specmd
    calibrate`` fits it on the experts' own kernel, ``hardware.roofline_serial``).

    ``gemv`` (bytes/s; 0: the memory bandwidth): the weights a one-row product reads (a GEMV: one token
    through an expert, a decode step's dense layers at batch 1) stream at their own rate -- a BLAS library
    dispatches one row to another kernel than two. On this 2-core VM's CPU a 46 MB weight read at 16 GB/s
    for one row and 7.3 GB/s for two (``hardware.gemv_bandwidth_gbps``: ``specmd calibrate`` fits both)."""

    peak_flops: float
    mem_bytes_per_s: float
    serial: float = 0.0
    gemv: float = 0.0

    def time(self, flops: float, nbytes: float, gemv_bytes: float = 0.0) -> float:
        """``gemv_bytes`` of the ``nbytes`` are read by one-row products."""
        return _roof(flops / self.peak_flops, _memory(nbytes, gemv_bytes, self.mem_bytes_per_s, self.gemv),
                     self.serial)


def _roof(a: float, b: float, serial: float) -> float:
    """The longer of compute ``a`` and memory ``b``, plus ``serial`` of the shorter (0.0: exactly the max)."""
    return (a if a > b else b) + serial * (b if a > b else a)


def _memory(nbytes: float, gemv_bytes: float, mem: float, gemv: float) -> float:
    """Seconds to read ``nbytes`` of weights at ``mem`` bytes/s, ``gemv_bytes`` of them by one-row products at
    ``gemv`` bytes/s (0: ``mem``; then exactly ``nbytes / mem``, the clock's bits without the GEMV rate)."""
    if gemv > 0.0 and gemv_bytes > 0.0:
        return (nbytes - gemv_bytes) / mem + gemv_bytes / gemv
    return nbytes / mem


def one_row(slots: float, experts: float) -> float:
    """How many of ``experts`` experts run one row when they share ``slots`` token-expert pairs: the fewest the
    counts allow, ``2 * experts - slots`` (each expert runs >= 1 row; if m run >= 2, ``slots >= experts + m``),
    clipped to [0, experts]: a lower bound. Exact where it matters most, a decode step at batch 1 (every
    expert one row); for a small batch, whose repeated experts are mostly shared by two tokens, close; for a
    prefill (slots >> experts) 0, where a few rarely chosen experts may still run one row. The clock sees
    counts only, not the selection's histogram (no per-call allocation)."""
    s = 2.0 * experts - slots
    return 0.0 if s < 0.0 else (experts if s > experts else s)


class SimClock(Clock):
    """Deterministic simulated time: one transfer channel plus a roofline per op (docs/semantics.md "Simulated clock").
    Time only moves when compute is charged or a stall is taken, so a run is a function of its inputs."""

    name = "simulated"

    def __init__(self, geom, channel: TransferChannel, roofline: Roofline, host: Roofline | None = None,
                 overheads: tuple = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0), decision: float = 0.0,
                 host_overheads: tuple = (0.0, 0.0, 0.0), overlap: bool = False, contention: float = 0.0):
        """``overheads``: (per decoder layer, per token of a pass, per expert run, per copy job issued -- a layer
        call's demand fetches are one job, each prefetch is one: the offload executor's batching --, per
        prefetch prediction, per expert run from a low-precision copy, per token per decoder layer, per expert a fetch
        places -- its slot's allocation and views, the eviction that made room: the executor's bookkeeping on
        the compute thread) seconds the roofline does not see (``specmd calibrate`` fits them; a decoder
        layer's cost goes with its dense compute, so it scales with the model's depth; issuing is host work
        charged with the layer's compute). ``decision``: seconds per MoE layer call the stack's policies
        cost beyond calibrate's reference stack (``hardware.policy_overhead_us``), charged with the layer's
        experts: the engine decides between the router and the experts, serial with compute. ``host_overheads``:
        (per layer call that sends the host work, per expert, per token-expert pair) seconds the host spends
        beyond its roofline (``hardware.host_call_overhead_us``, ``host_expert_overhead_us``,
        ``host_token_overhead_us``: ``specmd calibrate`` times the model's own experts on the host worker).

        ``overlap``, ``contention`` and the host as a resource: the module's "The host beside the device"."""
        self.geom = geom
        self.channel = channel
        self.roofline = roofline
        self.host_roofline = host or roofline
        (self.layer_overhead, self.token_overhead, self.expert_overhead, self.issue_overhead,
         self.predict_overhead, self.unpack_overhead, self.layer_token_overhead,
         self.place_overhead) = (tuple(overheads) + (0.0,) * 8)[:8]
        self.decision_overhead = decision
        self.host_call_overhead, self.host_expert_overhead, self.host_token_overhead = (tuple(host_overheads) + (0.0,) * 3)[:3]
        self.overlap = overlap
        self.contention = contention
        self.host_free_at = 0.0  # when the host work queued so far completes
        self.host_busy_s = 0.0
        self._host_acc = 0.0  # overlap: the host's overheads since the last synchronisation
        self._dev_acc = 0.0  # overlap: the device's compute since the last synchronisation
        self.issued = 0  # prefetches issued since the last charge of compute (each its own copy job)
        self.placed = 0  # experts placed by fetches since then (a slot's allocation, views, the eviction before)
        self._demand_job = False  # demand fetches issued since then (one copy job, however many)
        self.predictions = 0  # prefetch predictions since the last charge of compute
        self.now = 0.0
        self.stall_s = 0.0
        self._demand_ready = 0.0  # when the last demand fetch completes
        self._peak = roofline.peak_flops
        self._mem = roofline.mem_bytes_per_s
        self._serial = roofline.serial
        self._gemv = roofline.gemv
        self._expert_params = geom.expert_params
        self._expert_bytes = geom.expert_bytes
        self._hidden = geom.hidden_size
        self._dtype_bytes = geom.dtype_bytes
        self._dense_params = array("d", geom.dense_params)  # (doubles, as the C arithmetic reads them)
        self._attn_layers = array("d", geom.attn_layers)
        self._tail_params = geom.tail_params
        self._tail_attn_layers = geom.tail_attn_layers

    @classmethod
    def from_hardware(cls, geom, hw, policies: dict | None = None):
        """``policies``: the stack's ``{group: name}``, whose ``hardware.policy_overhead_us`` entries are
        charged per layer call."""
        return cls(geom, *_profile_terms(geom, hw, policies))

    # -- transfers --------------------------------------------------------------------------------
    def begin_layer(self):
        if self.overlap:  # the read-back of the routing: the host waits for the device to get there
            self.sync()
        if self.channel.queue:
            self.channel.advance(self.now)

    def sync(self):
        """The host waits for the device (``overlap``): the segment since the last one took the longer of the
        host's overheads and the device's compute."""
        if self._host_acc or self._dev_acc:
            self.now += max(self._host_acc, self._dev_acc)
            self._host_acc = self._dev_acc = 0.0

    def transfer_time(self, nbytes: int) -> float:
        return self.channel.duration(nbytes)

    def link_backlog(self) -> float:
        return max(0.0, self.channel.free_at - self.now)

    def host_backlog(self) -> float:
        return max(0.0, self.host_free_at - self.now)

    def busy(self) -> dict:
        return {"link_busy_s": self.channel.busy_s, "host_busy_s": self.host_busy_s}

    def host_beside_device(self) -> bool:
        return self.overlap

    def demand(self, nbytes: int, placed: int = 1):
        self._demand_job = True  # (a layer call's demand fetches go as one copy job: one issue)
        self.placed += placed
        ready = self.channel.demand(self.now, nbytes)
        if ready > self._demand_ready:
            self._demand_ready = ready
        return None

    def prefetch(self, nbytes: int, placed: int = 1):
        self.issued += 1
        self.placed += placed
        tr = self.channel.handle(nbytes, self.now)
        self.channel.submit(tr)
        return tr

    def promote(self, transfer):
        self.channel.promote(transfer, self.now)
        return transfer

    def done(self, handle):
        h = handle
        return h.ready_at <= self.now

    def wait(self, handles) -> float:
        if self.overlap:
            self.sync()
        t = self.now
        if self._demand_ready > t:  # the demand fetches issued since the last wait (``demand`` returns no handle)
            t = self._demand_ready
        for h in handles:
            if h.ready_at > t:
                t = h.ready_at
        return self.wait_until(t)

    def mark(self):
        return self.now, self.stall_s

    def since(self, mark):
        return self.now - mark[0], self.stall_s - mark[1]

    def host(self, slots, experts):
        d = self.host_time(slots, experts)
        tr = self.channel.handle(0, self.now)
        tr.started = True
        start = max(self.now, self.host_free_at)
        end = start + d
        if self.contention > 0.0 and experts:  # (the host's kernels contend; its per-call costs do not)
            k = self._host_kernel(slots, experts)
            end = self._contend(start, start + k) + (d - k)
        tr.ready_at = end
        self.host_free_at = end
        self.host_busy_s += end - start
        return tr

    def _contend(self, start: float, end: float) -> float:
        """Work of the host's processor over [start, end) beside the link's copies (``contention``): the
        copies and the work share host memory and, on a CPU, its cores, so their overlap costs
        ``contention`` of itself more, charged to whichever ends last -- the work (its new end is returned)
        or the link (the copy in flight, and the demand fetches waited on, end later)."""
        ch = self.channel
        if ch.queue:
            ch.advance(end)  # (the prefetches that start while the work runs)
        link_end = ch.free_at
        ov = (end if end < link_end else link_end) - start
        if ov <= 0.0:
            return end
        extra = self.contention * ov
        if end >= link_end:
            return end + extra
        ch.free_at = link_end + extra
        ch.busy_s += extra
        if self._demand_ready == link_end:
            self._demand_ready = link_end + extra
        last = ch.last
        if last is not None and last.ready_at == link_end:
            last.ready_at = link_end + extra
        return end

    def _compute(self, d: float, k: float) -> None:
        """With ``contention``: the device computes for ``d`` seconds from now, ``k`` of them in kernels
        (``overlap`` false: a CPU,
        whose compute is the host processor's work). The kernels contend with the link's copies; the rest --
        the framework's per-layer, per-expert and per-copy costs, one Python thread -- leaves the other cores
        to the copies (contended whole, a CPU's decodes came out 20% slower than measured)."""
        self.now = self._contend(self.now, self.now + k) + (d - k)

    # -- compute ----------------------------------------------------------------------------------
    def _host_kernel(self, slots: int, experts: int) -> float:
        """The host's roofline over ``experts`` experts sharing ``slots`` token-expert pairs."""
        g = self.geom
        return self.host_roofline.time(2.0 * slots * g.expert_params, experts * g.expert_bytes,
                                       one_row(slots, experts) * g.expert_bytes)

    def host_time(self, slots: int, experts: int) -> float:
        if not experts:
            return 0.0
        return (self._host_kernel(slots, experts) + self.host_call_overhead
                + experts * self.host_expert_overhead + slots * self.host_token_overhead)

    def compute(self, flops: float, nbytes: float) -> None:
        dt = self.roofline.time(flops, nbytes)
        self.now += dt

    def wait_until(self, t: float) -> float:
        if t > self.now:
            dt = t - self.now
            self.now = t
            self.stall_s += dt
            return dt
        return 0.0

    def _dense_time(self, params: float, attn_layers: float, tokens: float,
                    context: float) -> float:
        return (self._dense_device(params, attn_layers, tokens, context)
                + attn_layers * (self.layer_overhead + tokens * self.layer_token_overhead))

    def _dense_device(self, params: float, attn_layers: float, tokens: float,
                      context: float) -> float:
        """The device's share of :meth:`_dense_time` (its roofline, without the host's per-layer overhead); one
        token is a one-row product throughout (``Roofline.gemv``)."""
        # (every operand a double, in the order Python evaluates the same expression on its ints: the
        # compiled and the pure clock give the same bits while the products stay below 2**53)
        flops = 2.0 * tokens * params + 4.0 * tokens * context * self._hidden * attn_layers
        nbytes = params * self._dtype_bytes
        return _roof(flops / self._peak, _memory(nbytes, nbytes if tokens == 1.0 else 0.0, self._mem, self._gemv),
                     self._serial)

    def dense_time(self, layer: int, tokens: int, context: int) -> float:
        """Seconds of everything before MoE layer ``layer``'s experts (its share of dense layers)."""
        if not 0 <= layer < len(self._dense_params):  # (compiled, the arrays are read unchecked)
            raise IndexError(f"MoE layer {layer} of {len(self._dense_params)}")
        return self._dense_time(self._dense_params[layer], self._attn_layers[layer], tokens, context)

    def _experts_kernel(self, s: float, n: float) -> float:
        """The device's roofline over ``n`` experts sharing ``s`` token-expert pairs (:func:`one_row` of them
        one-row products)."""
        return _roof(2.0 * s * self._expert_params / self._peak,
                     _memory(n * self._expert_bytes, one_row(s, n) * self._expert_bytes, self._mem, self._gemv),
                     self._serial)

    def _experts_time(self, s: float, n: float) -> float:
        return self._experts_kernel(s, n) + n * self.expert_overhead

    def experts_time(self, slots: int, experts: int):
        """Seconds of a layer's routed experts: ``slots`` token-expert pairs over ``experts`` experts."""
        return self._experts_time(slots, experts)

    def dense(self, layer: int, tokens: int, context: int):
        if not 0 <= layer < len(self._dense_params):  # (compiled, the arrays are read unchecked)
            raise IndexError(f"MoE layer {layer} of {len(self._dense_params)}")
        if self.overlap:
            p = self._dense_params[layer]
            a = self._attn_layers[layer]
            self._dev_acc += self._dense_device(p, a, tokens, context)
            self._host_acc += a * (self.layer_overhead + tokens * self.layer_token_overhead)
            return
        p = self._dense_params[layer]
        a = self._attn_layers[layer]
        if self.contention > 0.0:
            self._compute(self._dense_time(p, a, tokens, context), self._dense_device(p, a, tokens, context))
        else:
            self.now += self._dense_time(p, a, tokens, context)

    def experts(self, slots: int, experts: int, unpacked: int = 0):
        if self.overlap:  # the decisions ran before (serial); the launches and the experts' compute side by side
            self.now += self.decision_overhead
            self._dev_acc += self._experts_kernel(slots, experts)
            self._host_acc += (experts * self.expert_overhead + (self.issued + self._demand_job) * self.issue_overhead
                               + self.predictions * self.predict_overhead + unpacked * self.unpack_overhead
                               + self.placed * self.place_overhead)
        else:
            d = (self._experts_time(slots, experts) + (self.issued + self._demand_job) * self.issue_overhead
                 + self.predictions * self.predict_overhead + self.decision_overhead + unpacked * self.unpack_overhead
                 + self.placed * self.place_overhead)
            if self.contention > 0.0:
                self._compute(d, self._experts_kernel(slots, experts))
            else:
                self.now += d
        self.issued = self.predictions = self.placed = 0
        self._demand_job = False

    def predicted(self):
        self.predictions += 1

    def tail(self, tokens: int, context: int):
        if self.overlap:  # the pass ends with its logits read back: a synchronisation
            self._dev_acc += self._dense_device(self._tail_params, self._tail_attn_layers, tokens, context)
            self._host_acc += (self._tail_attn_layers * (self.layer_overhead + tokens * self.layer_token_overhead)
                               + tokens * self.token_overhead)
            self.sync()
            return
        d = self._dense_time(self._tail_params, self._tail_attn_layers, tokens, context) + tokens * self.token_overhead
        if self.contention > 0.0:
            self._compute(d, self._dense_device(self._tail_params, self._tail_attn_layers, tokens, context))
        else:
            self.now += d


def _profile_terms(geom, hw, policies: dict | None) -> tuple:
    """:class:`SimClock`'s arguments after ``geom`` from a hardware profile ``hw`` (its fields in the units the
    profile states them) and the stack's ``{group: name}`` (their ``policy_overhead_us`` entries)."""
    def us(field: str) -> float:
        return getattr(hw, field, 0.0) * 1e-6

    table = getattr(hw, "policy_overhead_us", None) or {}
    decision = sum(table.get(f"{g}/{n}", 0.0) for g, n in (policies or {}).items()) * 1e-6
    device = Roofline(hw.peak_tflops * 1e12, hw.mem_bandwidth_gbps * 1e9, getattr(hw, "roofline_serial", 0.0),
                      (getattr(hw, "gemv_bandwidth_gbps", None) or 0.0) * 1e9)
    host = Roofline(hw.host_tflops * 1e12, hw.host_mem_bandwidth_gbps * 1e9, getattr(hw, "host_roofline_serial", 0.0),
                    (getattr(hw, "host_gemv_bandwidth_gbps", None) or 0.0) * 1e9)
    overheads = tuple(us(f) for f in ("layer_overhead_us", "token_overhead_us", "expert_overhead_us",
                                      "transfer_issue_us", "predict_overhead_us", "unpack_overhead_us",
                                      "layer_token_overhead_us", "place_overhead_us"))
    host_overheads = tuple(us(f) for f in ("host_call_overhead_us", "host_expert_overhead_us",
                                           "host_token_overhead_us"))
    return (TransferChannel(link_rate(hw, geom.expert_bytes), hw.latency_us * 1e-6), device, host, overheads,
            decision, host_overheads, bool(getattr(hw, "host_overlap", False)),
            getattr(hw, "host_link_contention", 0.0))
