"""What calibrate measures (stages 1-3 of the package's doc): the link from host memory and from the disk, the
experts' kernel as a roofline, the host and the link at once, the host's experts, the policies' decisions, and
the machine's speed (:func:`speed_probe`, for drift); each stage's result saved for the next calibrate
(:class:`Measurements`). Each figure is fitted in :mod:`.fit`."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ...models.loader import load_configured
from ...readers import number, pair
from ...results import content_fill, write_files
from ...machine import drift, in_passes, speed_probe  # noqa: F401 (calibrate records the speed it fitted at)
from .fit import LOW_QUANT, fit_kernel, fit_link, host_roofline, nnls

# (the small ones pin the latency: an expert of a small model is 49 kB; the large ones its bandwidth at a
# Qwen1.5-MoE expert's parameters: 23 MB fused gate and up, 12 MB down)
SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20)


def measure_ram_link(device: torch.device, reps: int = 5, sizes=SIZES, source_bytes: int = 128 << 20,
                     report: dict | None = None, rounds: int = 3, plan=None) -> tuple[float, float]:
    """The ``ram`` tier's own copies (:class:`~specmd.executor.tiers.RamTier`: one expert's row of a fused
    parameter into a slot) through the transfer channel, from sources cycling through ``source_bytes`` -- more than a last-level cache,
    so a copy reads memory as a fetch of a cold expert does (one source copied over and over measured the
    cache: 50 GB/s on a machine whose memory copies at half that). Each size timed in passes
    (:func:`in_passes`). ``plan``: the copy thread's placement (:class:`specmd.machine.CorePlan`)."""
    from ...accel import accel_for
    from ...executor.tiers import RamTier
    from ...executor.transfer import make_mover

    mover = make_mover(device, None, 0.0, plan)
    nrows = [max(4, source_bytes // size) for size in sizes]
    src = torch.empty(max(r * size for r, size in zip(nrows, sizes)) // 8, dtype=torch.int64).random_()
    # per size, one fused [rows, size] parameter (the tier's layout) over the same source memory -- a layer of
    # the tier each (on CUDA each pinned: 0.9 GB at once) --, copied one row at a time as a fetch copies one
    # expert's parameter into its slot
    tier = RamTier([{"w": src[: rows * size // 8].view(rows, size // 8)} for rows, size in zip(nrows, sizes)],
                   accel_for(device))
    dsts = [{"w": torch.empty(size // 8, dtype=torch.int64, device=device)} for size in sizes]
    def copy(li: int, i: int) -> float:
        row = i * 7 % nrows[li]
        t = mover.submit(lambda: tier.copy_into(li, row, dsts[li]), sizes[li], True)
        # the channel as a fetch sees it, hand-off included, until the bytes have *landed* (on CUDA a done
        # job's copies were only issued: timed to there, an H200's link came out at 9e4 GB/s)
        return mover.landed(t) - t.issued

    try:
        secs = in_passes(list(range(len(sizes))), copy, reps, rounds)
    finally:
        mover.close()
    return fit_link([(size, secs[li]) for li, size in enumerate(sizes)], report)


def measure_disk_link(device: torch.device, path: Path, reps: int = 5, report: dict | None = None, plan=None
                      ) -> tuple[float, float]:
    """pread into a tensor of the device's (host side) with the page cache dropped before each read."""
    from ...executor.transfer import ThreadMover

    total = 64 << 20
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.stat().st_size != total:
        # written under a temporary name and renamed: an interrupted write never leaves a short probe behind
        # (fsynced: dirty pages cannot be dropped, the reads below would hit memory; a probe of random bytes is
        # not kept elsewhere when the disk is full)
        write_files([(path, content_fill(os.urandom(total)))], keep=False)
    fd = os.open(path, os.O_RDONLY)
    mover = ThreadMover(None, 0.0, plan)
    points = []
    try:
        for size in SIZES:
            buf = torch.empty(size, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            times = []
            for r in range(reps):
                off = (r * size) % (total - size)
                os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)

                def job(off=off):
                    os.preadv(fd, [mv], off)

                t = mover.submit(job, size, True)
                mover.wait(t)
                times.append(t.finished - t.issued)  # the channel as a fetch sees it: hand-off included
            points.append((size, statistics.median(times)))
    finally:
        mover.close()
        os.close(fd)
    return fit_link(points, report)


# (hidden, intermediate) of the kernels the roofline is fitted on: one projection of an expert, from the
# embedded models' (128 x 256, 128 kB float32) to a Qwen1.5-MoE-sized shared expert's (2048 x 5632, 46 MB) --
# the sizes a run meets, each past the last-level cache but the first. Fitted on one 1024 x 1024 GEMM and a
# 128 MiB copy, the roofline put a 35 MB expert's decode GEMMs at half the time they take: a GEMV reads its
# weight once at well below a copy's bandwidth.
KERNEL_SHAPES = ((128, 256), (512, 1024), (1024, 2816), (2048, 5632))


KERNEL_TOKENS = (1, 2, 8, 32, 128)


def measure_compute(device: torch.device, reps: int = 5, rounds: int = 3, pool_bytes: int = 192 << 20
                    ) -> tuple[float, float, dict]:
    """(FLOP/s, weight bytes/s, report) of the device's roofline, fitted on the kernel the executor dispatches
    per expert projection (``torch.mm(x, w.t())``, :func:`~specmd.executor.kernel._linear`) at
    :data:`KERNEL_SHAPES` x :data:`KERNEL_TOKENS` rows: ``t = launch + max(c, m) + serial * min(c, m)``, ``c =
    flops / peak``, ``m = bytes / bandwidth`` -- the clock's roofline (``serial``: ``hardware.roofline_serial``)
    with a per-call constant that keeps small kernels from biasing the rates (the per-call cost itself is the
    fitted ``expert_overhead_us``) -- by SciPy's bounded nonlinear least squares on relative error. Each point
    the median over ``rounds`` passes of the median of ``reps`` calls, after a warm-up. The report: ``serial``, each point's measured and fitted
    microseconds, the fit's median and worst relative error.

    A one-row product reads its weight at its own rate (``report["gemv_bw"]``, ``hardware.gemv_bandwidth_gbps``:
    :class:`~specmd.engine.simclock.Roofline`): a BLAS library runs one row as a GEMV, two as a GEMM.

    On this 2-core VM the ideal roofline (serial 0) fitted with a 27% median error; the sum (serial ~1) with
    14%: a CPU's skinny GEMMs neither stream the weights at a copy's bandwidth while they multiply nor reach
    the GEMM peak. And one rate for every row count put a 46 MB weight's one row (2.9 ms: 16 GB/s) 42% long
    and its two rows (6.3 ms: 7.3 GB/s) 32% short -- a Qwen-shaped decode at batch 1 came out 20-30% slow."""
    # weights cycling through ``pool_bytes`` per shape, more than a last-level cache: a run's experts are read
    # from memory (one weight timed over and over measured the cache: 39 GB/s where the 35 MB experts of a
    # Qwen-shaped run read at 16)
    pools = [torch.rand(max(2, pool_bytes // (4 * h * f)), f, h, device=device) for h, f in KERNEL_SHAPES]
    cases = [(i, t) for i in range(len(KERNEL_SHAPES)) for t in KERNEL_TOKENS]
    xs = {(i, t): (torch.randn(t, KERNEL_SHAPES[i][0], device=device),
                   torch.empty(t, KERNEL_SHAPES[i][1], device=device)) for i, t in cases}
    for i, t in cases:  # (each kernel's first call)
        torch.mm(xs[i, t][0], pools[i][0].t(), out=xs[i, t][1])

    from ...accel import accel_for

    accel = accel_for(device)

    def mm(case: tuple, k: int) -> float:
        x, out = xs[case]
        ws = pools[case[0]]
        w = ws[k % ws.shape[0]]
        if accel is not None:
            accel.synchronize()
        t0 = time.perf_counter()
        torch.mm(x, w.t(), out=out)
        if accel is not None:
            accel.synchronize()
        return time.perf_counter() - t0

    secs = in_passes(cases, mm, reps, rounds)  # (in passes: a slow second lands in one)
    pts = []  # (flops, bytes, rows, seconds)
    for i, t in cases:
        h, f = KERNEL_SHAPES[i]
        pts.append((2.0 * t * h * f, 4.0 * h * f, t, secs[i, t]))
    return fit_kernel(pts)


def measure_contention(device: torch.device, hw: dict, reps: int = 5, plan=None) -> tuple[float, dict]:
    """``hardware.host_link_contention``: the host computing (an expert projection's kernel, as the host runs
    the experts of ``miss=cpu_compute``/``hybrid``) and the link copying (the ``ram`` tier's copies through
    the transfer channel), each alone and then both started together, sized to take about as long as each
    other (where the overlap, and so the contention, is largest). ``(together - max(alone)) / min(alone)``
    clipped to [0, 1], the median of ``reps``; and the report (the three times, ms)."""
    from ...accel import accel_for
    from ...executor.tiers import RamTier
    from ...executor.transfer import make_mover

    accel = accel_for(device)
    mover = make_mover(device, None, 0.0, plan)
    h, f = KERNEL_SHAPES[2]
    w = torch.randn(f, h)
    x = torch.randn(8, h)
    out = torch.empty(8, f)

    def host():
        for _ in range(4):
            torch.mm(x, w.t(), out=out)

    t0 = time.perf_counter()
    host()
    host_s = time.perf_counter() - t0
    size = 4 << 20
    copies = max(1, int(round(host_s * hw["bandwidth_gbps"] * 1e9 / size)))
    rows = max(8, (128 << 20) // size)
    tier = RamTier([{"w": torch.empty((rows, size // 8), dtype=torch.int64).random_()}], accel)
    dst = {"w": torch.empty(size // 8, dtype=torch.int64, device=device)}

    def link(r0: int, beside=None) -> float:
        """Seconds until the copies have landed (on CUDA done means issued: they land at the sync), with
        ``beside`` run on this thread meanwhile."""
        t0 = time.perf_counter()
        tickets = [mover.submit(lambda r=r: tier.copy_into(0, (r0 + r * 7) % rows, dst), size, True)
                   for r in range(copies)]
        if beside is not None:
            beside()
        for t in tickets:
            mover.wait(t)
        mover.sync()
        return time.perf_counter() - t0

    samples, times = [], []
    try:
        for rep in range(reps + 1):  # rep 0: warm-up
            t0 = time.perf_counter()
            host()
            a = time.perf_counter() - t0
            b = link(rep)
            both = link(rep + 3, host)
            if rep:
                samples.append(min(1.0, max(0.0, (both - max(a, b)) / min(a, b))))
                times.append((a, b, both))
    finally:
        mover.close()
    c = statistics.median(samples)
    a, b, both = (statistics.median(v) for v in zip(*times))
    return c, {"host_ms": a * 1e3, "link_ms": b * 1e3, "together_ms": both * 1e3, "copies": copies,
               "copy_bytes": size}


def measure_host_experts(model, family: str, hw: dict, device: torch.device, reps: int = 15, plan=None
                         ) -> tuple[dict, dict]:
    """The host's costs beyond its roofline for the model's own experts (its family's layout, its size),
    computed as the offload executor computes them (:mod:`~specmd.executor.hostwork`: one bank of the layer's
    ``[E, ...]`` tensors in host memory; on CUDA handed to the worker thread, the rows copied from the device
    and the result back, and joined; on a CPU inline) for 1, 2 and 4
    experts of 1 and 8 tokens each, the best of ``reps``; (measured - host roofline) fitted as ``call +
    experts * expert + pairs * token`` (non-negative least squares). Returns ({``host_call_overhead_us``,
    ``host_expert_overhead_us``, ``host_token_overhead_us``}, {case: measured us})."""
    from ...executor.hostwork import HOST_COMPUTE
    from ...executor.kernel import Bank, bank_where_it_is, expert_tensors
    from ...models.adapters import adapter_for

    adapter = adapter_for(family)
    mod = adapter.experts(model, adapter.moe_layers(model)[0])
    E = adapter.num_experts(model.config)
    tensors = {n: t.detach().cpu() for n, t in expert_tensors(mod, E).items()}
    params = sum(t[0].numel() for t in tensors.values())
    nbytes = sum(t[0].numel() * t.element_size() for t in tensors.values())
    layout = adapter.experts_layout
    names, transposed, gated = layout.names, layout.transposed, layout.gated
    H = tensors[names[1]].shape[2 if transposed else 1]
    dtype = next(iter(tensors.values())).dtype
    from ...accel import accel_for

    accel = accel_for(device)
    worker, bank = HOST_COMPUTE["thread" if accel is not None else "inline"](plan), Bank(tensors, 0, E)
    X, y, cases = [], [], {}
    try:
        with torch.no_grad():
            for n in (1, 2, 4):
                for tok in (1, 8):
                    x = torch.randn(n * tok, H, dtype=dtype, device=device)
                    groups = ([tok * (i + 1) for i in range(n)], list(range(n)))
                    best = float("inf")
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        worker.submit(bank_where_it_is, mod, x, None, bank, groups, names, transposed, gated).result()
                        if accel is not None:
                            accel.synchronize()
                        best = min(best, time.perf_counter() - t0)
                    roof = host_roofline(hw).time(2.0 * n * tok * params, n * nbytes, n * nbytes if tok == 1 else 0.0)
                    X.append([1.0, n, n * tok])
                    y.append(best - roof)
                    cases[f"{n} experts x {tok} tokens"] = best * 1e6
    finally:
        worker.close()
    X, y = np.array(X), np.array(y)
    coef = nnls(X / (y.max() or 1.0), y / (y.max() or 1.0))
    return ({"host_call_overhead_us": float(coef[0] * 1e6), "host_expert_overhead_us": float(coef[1] * 1e6),
             "host_token_overhead_us": float(coef[2] * 1e6)}, cases)


REFERENCE = {"eviction": "lru", "prefetch": "topk", "miss": "fetch"}  # calibrate's reference stack: its costs are in the fit


def measure_policies(model_name: str, hw: dict, device: torch.device, new_tokens: int = 8, reps: int = 1,
                     log=print) -> tuple[dict, dict]:
    """Host microseconds per MoE layer call each built-in eviction, prefetch and miss policy's decisions cost
    beyond the reference stack's (lru, topk, fetch: theirs are in the fitted overheads; a miss policy runs with
    the HQQ copies it may fetch, and its cost includes the longer victim scans of a pool holding smaller copies), as ``{"<group>/<name>": us}``
    (``hardware.policy_overhead_us``), and ``{"<group>/<name>": why}`` of those that cannot run in a plain
    live generation (an oracle needs the future). The engine's :meth:`~specmd.engine.Engine.layer` -- every
    cache decision of a layer call, prefetch predictions included -- is timed over a greedy generation at
    the profile's capacity under ``execution=simulated`` (the decisions are the same as offload's; the
    model's compute is not in the timed span), the best of ``reps``, per call. Costs depend on the model's
    geometry (a percentile over E scores, victims scanned over the pool): calibrate with ``--model`` set to
    the geometry you run."""
    from ...compose import spec_of
    from ...errors import ConfigError
    from ...hardware import HardwareConfig
    from ...policies import REGISTRIES

    model, _ = load_configured(model_name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=g).to(device)
    model.to(device)

    def per_call(stack: dict) -> float:
        return _layer_call_seconds(model, ids, spec_of(hardware=HardwareConfig(**hw), **stack), device, new_tokens,
                                   reps)

    # the reference stack timed three times -- first, halfway and last -- and its median kept: timed once, one
    # hiccup of the machine during it (2.3 ms per call where it takes 80-110 us) zeroed every policy's cost
    todo = [(g, n) for g, reference in REFERENCE.items() for n in REGISTRIES[g].names() if n not in (reference, "none")]
    refs, raw, skipped = [per_call({})], {}, {}
    for i, (group, name) in enumerate(todo):
        if i == len(todo) // 2:
            refs.append(per_call({}))
        key = f"{group}/{name}"
        try:
            raw[key] = per_call({group: name, **({"quant": LOW_QUANT} if group == "miss" else {})})
        except ConfigError as exc:  # a policy this run cannot host (an oracle): named in the profile; a bug raises
            skipped[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    refs.append(per_call({}))
    ref = statistics.median(refs)
    costs = {k: max(0.0, (v - ref) * 1e6) for k, v in raw.items()}
    log(f"  policy decisions ({model_name}, us per layer call beyond lru+topk+fetch's {ref * 1e6:.3g} us): "
        + ", ".join(f"{k} {v:.3g}" for k, v in costs.items())
        + (f"; not measured: {', '.join(skipped)}" if skipped else ""))
    return costs, skipped


def _layer_call_seconds(model, ids, spec, device, new_tokens: int, reps: int) -> float:
    """Seconds per call of the engine's :meth:`~specmd.engine.Engine.layer` over a greedy generation from
    ``ids`` under ``spec``, the best of ``reps`` installs."""
    from ...hook import install

    best = float("inf")
    for _ in range(reps):
        st = install(model, spec, device=device)
        eng = st.engine
        layer, spent = eng.layer, [0.0, 0]

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = layer(*a, **k)
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
            return out

        eng.layer = timed
        try:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
        finally:
            st.remove()
        best = min(best, spent[0] / max(spent[1], 1))
    return best


def disk_probe_path() -> Path:
    from ...quant.base import cache_dir

    return cache_dir().parent / "calibrate" / "disk-probe.bin"


MEASURE_VERSION = 5  # bump when a measurement changes meaning: older saved measurements are not reused


def measurement_key(model: str, device: str, plan=None) -> dict:
    """What a saved measurement is valid for: this host, device, torch, the thread placement it was measured at
    (:class:`specmd.machine.CorePlan`: threads, pin, host threads, cores), the model it was fitted on, and the
    version of the measurements."""
    placed = {} if plan is None else {"threads": plan.threads, "pin": plan.pin, "host_threads": plan.host_threads,
                                      "cores": plan.cores}
    return {"host": platform.node(), "device": str(device), "torch": torch.__version__, "model": model, **placed,
            "version": MEASURE_VERSION}


_RATE = number(above=0)  # (a reused negative bandwidth went into the profile)
_LINK = {"bw": _RATE, "lat": number(at_least=0), "report": dict}
# each saved stage's shape (what the stage returns, as JSON gives it back), its figures in their ranges
STAGE_SHAPES = {"link": _LINK, "disk": _LINK,
                "compute": {"flops": _RATE, "mem": _RATE, "kernel": dict, "hflops": _RATE, "hmem": _RATE,
                            "host_kernel": dict},
                "contention": pair(number(at_least=0, at_most=1), dict), "host_experts": pair(dict, dict),
                "policies": pair(dict, dict), "overheads": pair(dict, dict)}


class Measurements:
    """calibrate's measurements, each stage saved as it completes (``$SPECMD_CACHE/../calibrate/<key>.json``,
    atomically) and reused by a later calibrate of the same :func:`measurement_key` unless ``remeasure``:
    a second calibrate (another name, ``--out``) takes seconds, and an interrupted one resumes at the stage
    it was in."""

    def __init__(self, key: dict, remeasure: bool):
        import hashlib

        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = disk_probe_path().parent / f"measured-{digest}.json"
        self.key, self.reused = key, []
        self.data = {}
        self.dropped: list = []  # why a saved stage was not reused (a damaged or hand-edited file): measured again
        if not remeasure and self.path.is_file():
            self.data = self._read()

    def _read(self) -> dict:
        """The saved stages of this key that have their shape (:data:`STAGE_SHAPES`); a damaged file or stage is
        measured again, said in :attr:`dropped` (never reused as is: a stage of the wrong shape failed every
        later calibrate, silently, until ``--remeasure``)."""
        from ...errors import DamagedFile
        from ...readers import check, read_json

        try:
            saved = read_json(self.path, "calibrate's saved measurements")
        except (OSError, DamagedFile) as exc:
            self.dropped.append(str(exc))
            return {}
        if saved.get("key") != self.key:
            return {}
        stages = saved.get("stages")
        if not isinstance(stages, dict):
            self.dropped.append(f"{self.path}: stages is not a mapping")
            return {}
        out = {}
        for name, value in stages.items():
            try:
                check({name: value}, {name: STAGE_SHAPES.get(name, lambda v: None)}, self.path, "stages")
                out[name] = value
            except DamagedFile as exc:
                self.dropped.append(str(exc))
        return out

    def stage(self, name: str, fn):
        """The saved result of stage ``name``, or ``fn()``'s, saved (a safe point: a signal recorded during the
        last one is raised here, what was measured before it kept)."""
        from ...signals import check_interrupt

        check_interrupt()
        if name in self.data:
            self.reused.append(name)
            return self.data[name]
        value = fn()
        from ...results import write_json_atomic

        self.data[name] = json.loads(json.dumps(value))  # (as read back: tuples as lists)
        write_json_atomic(self.path, {"key": self.key, "stages": self.data})
        return self.data[name]
