"""``specmd calibrate [--out DIR] [--name NAME] [--model MODEL] [--device DEV] [--quick]``: measure this machine
and write a hardware profile that makes the simulated clock predict what ``execution=offload`` measures.

1. **The link, per host tier**: the transfer path's own copies (:class:`~specmd.executor.transfer.ThreadMover`,
   unthrottled) of 64 KiB .. 32 MiB from host memory (``ram``) and, with the page cache dropped, from a file
   (``disk``); ``latency + nbytes / bandwidth`` fitted by least squares, with a faster rate for a copy's first
   MBs where that fits better (``small_copy_gbps``/``small_copy_mb``: :func:`_fit_link`).
2. **Compute**: the experts' own kernel at four weight sizes and one to 128 rows, fitted as the clock's
   roofline (``peak_tflops``, ``mem_bandwidth_gbps``, ``gemv_bandwidth_gbps`` for one row,
   ``roofline_serial``: :func:`measure_compute`), the same on the host (``host_*``; equal on a CPU-only
   machine); then the host and the link at once (``host_link_contention``: :func:`measure_contention`).
3. **Policy decisions** (measured before 4): each built-in eviction, prefetch and miss policy's host time per
   MoE layer call beyond the reference stack's (lru, topk, fetch), timed on the engine
   (``hardware.policy_overhead_us``).
4. **What the roofline does not see**: the model (default: the embedded ``deep_olmoe``) generates greedily
   under ``execution=offload`` -- all resident, at 5% with prefetching, all resident with prefetching, and
   at 5% fetching HQQ copies (``miss=fetch_priority``, with lru + topk and with least_stale + score);
   prefills of 8..448 tokens, then decodes -- three times, each in a fresh install; each pass's measured
   compute time minus its simulated compute time (the median of the three) is fitted as ``decoder layers *
   layer + tokens * decoder layers * token + experts run * expert + copy jobs issued * issue + experts placed *
   place + predictions * prediction + experts unpacked * unpack`` overheads (non-negative least squares on relative error; the unpack term last,
   on the low-precision stacks' residuals, their policies' decision costs from 3 charged): the costs of eager
   framework calls and of issuing copies that a GPU hides in kernel launches and a CPU does not.

The profile goes to ``DIR/hardware/<name>.yaml``; the default DIR is the user config directory, which
specmd puts on Hydra's search path (``hardware=<name>`` works at once; with ``--out``, add
``hydra.searchpath=[file://DIR]``). ``<name>_disk.yaml`` carries the disk tier's link.

Before it measures (minutes), calibrate checks what it was given (:func:`prepare`): the name is a name
(:func:`check_name`: no path, no override syntax, not a shipped profile's), DIR is a directory it can write
(:func:`check_output`), and the model loads here (:func:`check_model`: offline, a hub model is a DataError at
once). Bad input is a ConfigError. The profiles are written to temporary files beside them and renamed when
complete (:func:`_write_atomic`): an interrupted or failed calibrate leaves no half-written profile.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import FULL_ERRNOS, PATH_ERRNOS
from ..results import writable_dir

# (the small ones pin the latency: an expert of a small model is 49 kB; the large ones its bandwidth at a
# Qwen1.5-MoE expert's parameters: 23 MB fused gate and up, 12 MB down)
SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20)


def _fit_link(points: list[tuple[int, float]], report: dict | None = None) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the link's copies, ``t = latency + min(n, K) / small + max(0, n - K) /
    bandwidth``: the first ``K`` bytes of a copy at the ``small`` rate (``hardware.small_copy_gbps``,
    ``small_copy_mb``), the knee ``K`` one of the measured sizes or none (one rate), whichever fits best by
    least squares on relative error (SciPy's bounded linear least squares; on absolute error the 16 MiB
    copies' jitter, +-100 us, set the latency: 0-65 us from run to run). On this 2-core VM a copy of up to
    4-8 MiB ran at 9-18 GB/s (five calibrations) and beyond at 6-8: one rate over 64 kB-32 MiB came out at 11 GB/s and put a 35 MB
    expert's copy at 0.6 of its time. ``report`` (a dict) receives ``small_bw`` and ``small_bytes`` (None:
    no knee), each point's measured and fitted microseconds and the fit's median and worst error."""
    from scipy.optimize import lsq_linear

    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    best = None
    for knee in [None] + sorted(set(n))[1:-2]:  # (a knee leaves >= 2 sizes beyond it to fit its rate)
        head = n if knee is None else np.minimum(n, knee)
        X = np.stack([np.ones_like(n), head, n - head], axis=1) / t[:, None]
        if knee is None:
            X = X[:, :2]
        fit = lsq_linear(X, np.ones_like(t), bounds=(0.0, np.inf))
        if knee is not None and not 0.0 < fit.x[1] < fit.x[2]:
            continue  # (a knee only where the small copies run faster: else one rate, the no-knee fit)
        pred = (X @ fit.x) * t
        err = float(np.sum((pred / t - 1) ** 2))
        if best is None or err < best[0] - 1e-12:
            best = (err, knee, fit.x, pred)
    _, knee, x, pred = best
    lat = float(x[0])
    if knee is None:
        slope, small_bw, small_bytes = x[1], None, None
    else:
        slope, small_bw, small_bytes = x[2], 1.0 / x[1], float(knee)
    bw = 1.0 / max(float(slope), 1e-15)
    if report is not None:
        report.update({"small_bw": small_bw, "small_bytes": small_bytes,
                       "points": [{"bytes": float(a), "measured_us": float(b * 1e6), "fitted_us": float(c * 1e6)}
                                  for a, b, c in zip(n, t, pred)],
                       "median_abs_err": float(np.median(np.abs(pred / t - 1))),
                       "max_abs_err": float(np.max(np.abs(pred / t - 1)))})
    return bw, lat


def _in_passes(cases: list, time_one, reps: int, rounds: int) -> dict:
    """Each case's seconds: ``rounds`` passes over all ``cases``, in each the median of ``reps`` calls of
    ``time_one(case, i)`` (seconds; ``i`` counts every call, to cycle sources), and the median over the passes
    kept. A slow second of a shared machine lands in one pass, not on a run of neighbouring cases: measured
    case after case, one such second put three of the 46 MB kernel cases at 3-4x their time and the fit's
    bandwidth 30% low, and the link's bulk rate moved by 15% between calibrations."""
    per = {c: [] for c in cases}
    i = 0
    for _ in range(rounds):
        for c in cases:
            times = []
            for _ in range(reps):
                i += 1
                times.append(time_one(c, i))
            per[c].append(statistics.median(times))
    return {c: statistics.median(v) for c, v in per.items()}


def measure_ram_link(device: torch.device, reps: int = 5, sizes=SIZES, source_bytes: int = 128 << 20,
                     report: dict | None = None, rounds: int = 3) -> tuple[float, float]:
    """The ``ram`` tier's own copies (:class:`~specmd.executor.tiers.RamTier`: one expert's row of a fused
    parameter into a slot) through the transfer channel, from sources cycling through ``source_bytes`` -- more than a last-level cache,
    so a copy reads memory as a fetch of a cold expert does (one source copied over and over measured the
    cache: 50 GB/s on a machine whose memory copies at half that). Each size timed in passes
    (:func:`_in_passes`)."""
    from ..executor.tiers import RamTier
    from ..executor.transfer import CudaMover, ThreadMover

    mover = CudaMover(None, 0.0, device) if device.type == "cuda" else ThreadMover(None, 0.0)
    nrows = [max(4, source_bytes // size) for size in sizes]
    src = torch.empty(max(r * size for r, size in zip(nrows, sizes)) // 8, dtype=torch.int64).random_()
    # per size, one fused [rows, size] parameter (the tier's layout) over the same source memory -- a layer of
    # the tier each (on CUDA each pinned: 0.9 GB at once) --, copied one row at a time as a fetch copies one
    # expert's parameter into its slot
    tier = RamTier([{"w": src[: rows * size // 8].view(rows, size // 8)} for rows, size in zip(nrows, sizes)],
                   pin=device.type == "cuda")
    dsts = [{"w": torch.empty(size // 8, dtype=torch.int64, device=device)} for size in sizes]
    def copy(li: int, i: int) -> float:
        row = i * 7 % nrows[li]
        t = mover.submit(lambda: tier.copy_into(li, row, dsts[li]), sizes[li], True)
        mover.wait(t)
        return t.finished - t.issued  # the channel as a fetch sees it: hand-off included

    try:
        secs = _in_passes(list(range(len(sizes))), copy, reps, rounds)
    finally:
        mover.close()
    return _fit_link([(size, secs[li]) for li, size in enumerate(sizes)], report)


def measure_disk_link(device: torch.device, path: Path, reps: int = 5, report: dict | None = None
                      ) -> tuple[float, float]:
    """pread into a tensor of the device's (host side) with the page cache dropped before each read."""
    from ..executor.transfer import ThreadMover

    total = 64 << 20
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.stat().st_size != total:
        # written under a temporary name and renamed: an interrupted write never leaves a short probe behind
        # (fsynced: dirty pages cannot be dropped, the reads below would hit memory; a probe of random bytes is
        # not kept elsewhere when the disk is full)
        _write_atomic([(path, os.urandom(total))], keep=False)
    fd = os.open(path, os.O_RDONLY)
    mover = ThreadMover(None, 0.0)
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
    return _fit_link(points, report)


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
    :class:`~specmd.engine.clock.Roofline`): a BLAS library runs one row as a GEMV, two as a GEMM.

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

    def mm(case: tuple, k: int) -> float:
        x, out = xs[case]
        ws = pools[case[0]]
        w = ws[k % ws.shape[0]]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(x, w.t(), out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    secs = _in_passes(cases, mm, reps, rounds)  # (in passes: a slow second lands in one)
    pts = []  # (flops, bytes, rows, seconds)
    for i, t in cases:
        h, f = KERNEL_SHAPES[i]
        pts.append((2.0 * t * h * f, 4.0 * h * f, t, secs[i, t]))
    return _fit_kernel(pts)


def _fit_kernel(pts: list[tuple[float, float, int, float]]) -> tuple[float, float, dict]:
    """:func:`measure_compute`'s fit of its points (flops, weight bytes, rows, seconds)."""
    from scipy.optimize import least_squares

    F, B, R, T = (np.array(c, dtype=float) for c in zip(*pts))
    one = R == 1

    def model(p):  # p: log peak, log bandwidth, log one-row bandwidth, launch seconds, serial
        c, m = F / np.exp(p[0]), B / np.exp(np.where(one, p[2], p[1]))
        return p[3] + np.maximum(c, m) + p[4] * np.minimum(c, m)

    # (a max is not smooth: started from each corner of the rates' lower bounds and the serial share, the best
    # fit kept)
    lo = [np.log(np.max(F / T)), np.log(np.max(B / T)), np.log(np.max(B / T))]
    fit = min((least_squares(lambda p: model(p) / T - 1.0, [lo[0] + a, lo[1] + b, lo[2] + b, 0.0, s],
                             bounds=([-np.inf] * 3 + [0.0, 0.0], [np.inf] * 4 + [1.0]), method="trf")
               for a in (0.0, 2.0) for b in (0.0, 1.0) for s in (0.0, 0.5, 1.0)), key=lambda f: f.cost)
    peak, bw, gemv = (float(np.exp(fit.x[i])) for i in range(3))
    pred = model(fit.x)
    report = {"serial": float(fit.x[4]), "launch_us": float(fit.x[3] * 1e6), "gemv_bw": gemv,
              "points": [{"flops": float(a), "bytes": float(b), "rows": int(r), "measured_us": float(t * 1e6),
                          "fitted_us": float(p * 1e6)} for a, b, r, t, p in zip(F, B, R, T, pred)],
              "median_abs_err": float(np.median(np.abs(pred / T - 1))),
              "max_abs_err": float(np.max(np.abs(pred / T - 1)))}
    return peak, bw, report


def speed_probe(device: torch.device, reps: int = 5, rounds: int = 3) -> dict:
    """The machine's speed now, for a later run to compare with (``specmd fidelity``: a shared VM runs 10-25%
    slower or faster from one quarter of an hour to the next, and a profile fitted in a fast one predicts a
    slow one short in every cell): timed in passes (:func:`_in_passes`), in microseconds, one expert
    projection's kernel (1024 x 2816 at 8 rows, weights cycling beyond the
    last-level cache) and of a fixed stretch of Python (the interpreter work a small model's framework costs
    are made of)."""
    h, f = KERNEL_SHAPES[2]
    ws = torch.rand(max(2, (96 << 20) // (4 * h * f)), f, h, device=device)
    x, out = torch.randn(8, h, device=device), torch.empty(8, f, device=device)
    table = {i: i for i in range(64)}

    def kernel(k):
        torch.mm(x, ws[k % ws.shape[0]].t(), out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def python(k):
        acc = 0
        for i in range(4000):
            acc += table.get((i + k) & 63, 0)
        return acc

    def timed(name: str, k: int) -> float:
        t0 = time.perf_counter()
        (kernel if name == "kernel_us" else python)(k)
        return time.perf_counter() - t0

    kernel(0)
    return {name: s * 1e6 for name, s in _in_passes(["kernel_us", "python_us"], timed, reps, rounds).items()}


def drift(then: dict | None, now: dict) -> dict | None:
    """``now`` / ``then`` per :func:`speed_probe` figure (> 1: the machine is slower now than when the profile
    was fitted); None without ``then`` (a profile from before the probe, or hand-written)."""
    if not then:
        return None
    return {k: now[k] / then[k] for k in now if then.get(k)}


def measure_contention(device: torch.device, hw: dict, reps: int = 5) -> tuple[float, dict]:
    """``hardware.host_link_contention``: the host computing (an expert projection's kernel, as the host runs
    the experts of ``miss=cpu_compute``/``hybrid``) and the link copying (the ``ram`` tier's copies through
    the transfer channel), each alone and then both started together, sized to take about as long as each
    other (where the overlap, and so the contention, is largest). ``(together - max(alone)) / min(alone)``
    clipped to [0, 1], the median of ``reps``; and the report (the three times, ms)."""
    from ..executor.tiers import RamTier
    from ..executor.transfer import CudaMover, ThreadMover

    mover = CudaMover(None, 0.0, device) if device.type == "cuda" else ThreadMover(None, 0.0)
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
    tier = RamTier([{"w": torch.empty((rows, size // 8), dtype=torch.int64).random_()}], pin=device.type == "cuda")
    dst = {"w": torch.empty(size // 8, dtype=torch.int64, device=device)}

    def link(r0: int):
        tickets = [mover.submit(lambda r=r: tier.copy_into(0, (r0 + r * 7) % rows, dst), size, True)
                   for r in range(copies)]
        return tickets

    samples, times = [], []
    try:
        for rep in range(reps + 1):  # rep 0: warm-up
            t0 = time.perf_counter()
            host()
            a = time.perf_counter() - t0
            t0 = time.perf_counter()
            for t in link(rep):
                mover.wait(t)
            b = time.perf_counter() - t0
            t0 = time.perf_counter()
            tickets = link(rep + 3)
            host()
            for t in tickets:
                mover.wait(t)
            both = time.perf_counter() - t0
            if rep:
                samples.append(min(1.0, max(0.0, (both - max(a, b)) / min(a, b))))
                times.append((a, b, both))
    finally:
        mover.close()
    c = statistics.median(samples)
    a, b, both = (statistics.median(v) for v in zip(*times))
    return c, {"host_ms": a * 1e3, "link_ms": b * 1e3, "together_ms": both * 1e3, "copies": copies,
               "copy_bytes": size}


def host_roofline(hw: dict):
    """The host's roofline of a profile (``host_tflops``, ``host_mem_bandwidth_gbps``): the clock's own."""
    from ..engine.clock import Roofline

    return Roofline(hw["host_tflops"] * 1e12, hw["host_mem_bandwidth_gbps"] * 1e9, hw.get("host_roofline_serial", 0.0),
                    (hw.get("host_gemv_bandwidth_gbps") or 0.0) * 1e9)


def measure_host_experts(model, family: str, hw: dict, device: torch.device, reps: int = 15) -> tuple[dict, dict]:
    """The host's costs beyond its roofline for the model's own experts (its family's layout, its size),
    computed as the offload executor computes them (:mod:`~specmd.executor.hostwork`: one bank of the layer's
    ``[E, ...]`` tensors in host memory; on CUDA handed to the worker thread, the rows copied from the device
    and the result back, and joined; on a CPU inline) for 1, 2 and 4
    experts of 1 and 8 tokens each, the best of ``reps``; (measured - host roofline) fitted as ``call +
    experts * expert + pairs * token`` (non-negative least squares). Returns ({``host_call_overhead_us``,
    ``host_expert_overhead_us``, ``host_token_overhead_us``}, {case: measured us})."""
    from ..executor.hostwork import HOST_COMPUTE
    from ..executor.kernel import Bank, _remote_bank, expert_tensors
    from ..models.adapters import adapter_for

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
    worker, bank = HOST_COMPUTE["thread" if device.type == "cuda" else "inline"](), Bank(tensors, 0, E)
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
                        worker.submit(_remote_bank, mod, x, None, bank, groups, names, transposed, gated).result()
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        best = min(best, time.perf_counter() - t0)
                    roof = host_roofline(hw).time(2.0 * n * tok * params, n * nbytes, n * nbytes if tok == 1 else 0.0)
                    X.append([1.0, n, n * tok])
                    y.append(best - roof)
                    cases[f"{n} experts x {tok} tokens"] = best * 1e6
    finally:
        worker.close()
    X, y = np.array(X), np.array(y)
    coef = _nnls(X / (y.max() or 1.0), y / (y.max() or 1.0))
    return ({"host_call_overhead_us": float(coef[0] * 1e6), "host_expert_overhead_us": float(coef[1] * 1e6),
             "host_token_overhead_us": float(coef[2] * 1e6)}, cases)


# prefill sizes: the token and expert terms are identifiable, and a long prompt's TTFT (GSM8K's 5-shot prompts:
# ~480 tokens) is inside the fitted range: fitted on 8-128 only, the token term came out anywhere in 70-220 us
# and its extrapolation to 480 tokens put TTFT at 0.75-1.0 of measured
PROMPTS = (8, 32, 128, 448)
# the stored copies calibrate's low-precision runs fetch (optimize=false: quantized in seconds; unpacking
# costs the same either way)
LOW_QUANT = {"name": "hqq", "precisions": ["int8", "int4", "int2"], "optimize": False}


def fit_overheads(model_name: str, hw: dict, device: torch.device, new_tokens: int = 10, reps: int = 3
                  ) -> tuple[dict, dict]:
    """Overheads (µs) from greedy generations under execution=offload; per pass residual = measured -
    roofline, regressed on (decoder layers, tokens, experts run, copy jobs issued, predictions made, experts
    placed; then experts unpacked).
    Returns (overheads, fit report).

    Robust by construction, because a single pass of a few ms on a shared CPU varies by tens of percent
    (single-pass fits gave a token overhead anywhere in 0-257 us on the same machine, and TTFT predictions
    0.65-1.0 of measured):

    - every generation runs ``reps`` times, each in a fresh install (cold cache: the same decisions, so
      the same regressors), and each pass's residual is the **median** over the repetitions;
    - prefills of ``PROMPTS`` tokens (not one or two sizes): tokens and experts run vary independently
      enough to separate their terms, and TTFT's prompt lies inside the range it is predicted from;
    - rows are weighted by 1 / the pass's measured time, so the fit minimises *relative* error: the many
      short decode passes do not outvote the few prefills (TTFT and TPOT are judged by ratios);
    - one generation before the repetitions warms the framework (first calls of kernels, allocator), and one
      at the start of each install, discarded, its first evictions (as ``specmd fidelity``'s cells do)."""
    from ..compose import spec_of
    from ..executor import EXECUTION
    from ..hardware import HardwareConfig
    from ..hook import install
    from ..models.loader import local_checkpoint

    model, mcfg = _load(model_name)
    model.to(device)
    ckpt = local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None
    vocab = model.config.vocab_size  # (token ids over the whole vocabulary: routing as diverse as text's -- ids
    # below 250 routed a 480-token prefill to fewer experts than a GSM8K prompt, and the transfer term came out
    # too large: the default job's TTFT at 0.71-0.87 of the prediction)
    longest = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    prompts = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
               for n in PROMPTS if n + new_tokens <= longest]
    layers = None
    rows: dict[tuple, list] = {}  # (stack, prompt, pass) -> [regressors, [residual per rep], [measured per rep]]
    # five stacks: all resident (no transfers after the first pass), a small cache with prefetching (many
    # transfers issued), all resident with prefetching (predictions without transfers), and two small caches
    # fetching stored low-precision copies (experts unpacked before they run; with two stacks' policies, since
    # the arena's compactions come with the unpacking): each term is identifiable
    low = {"miss": "fetch_priority", "quant": LOW_QUANT}
    stacks = ((1.0, "none", {}), (0.05, "topk", {}), (1.0, "topk", {}), (0.05, "topk", low),
              (0.05, "score", dict(low, eviction="least_stale")),  # unpacking's cost with two stacks' arenas
              (0.05, "topk", {"miss": "hybrid"}))  # the host's experts, timed per call (not in the pass fit)
    host_calls: list = []  # (experts, rows, seconds) of every host bank the hybrid stack computed
    for rep in range(-1, reps):  # rep -1: the warm-up, discarded
        for si, (capacity, prefetch, extra) in enumerate(stacks):
            spec = spec_of(hardware=HardwareConfig(**{**hw, "capacity": capacity}), prefetch=prefetch, **extra)
            spec.execution = EXECUTION.params({"name": "offload", "throttle": True})
            stack = install(model, spec, device=device, checkpoint=ckpt)
            ex, eng = stack.executor, stack.engine
            hybrid = extra.get("miss") == "hybrid"
            counts = []  # per pass: (copy jobs issued, predictions made, experts placed, experts unpacked) at its start, then deltas
            begin, end = ex.begin_pass, ex.end_pass
            place = ex.placement
            ex.begin_pass = lambda kind, tokens: (counts.append((place.jobs, eng.predictions, place.copies,
                                                                 place.low_runs)), begin(kind, tokens))
            ex.end_pass = lambda: (end(), counts.__setitem__(-1, (place.jobs - counts[-1][0],
                                                                   eng.predictions - counts[-1][1],
                                                                   place.copies - counts[-1][2],
                                                                   place.low_runs - counts[-1][3])))
            first = []  # pass index where each prompt's generation starts
            try:
                with torch.no_grad():
                    # the install's first generation, discarded: its first prefill pays what a run pays once
                    # (the first evictions, the first activations of a size) -- counted, it put the 8-token
                    # prefills 8% above the fit and the fit 7-13% above a warmed 32-token prefill
                    if rep >= 0:  # (the warm-up repetition is discarded whole)
                        model.generate(torch.flip(prompts[1], (1,)), max_new_tokens=2, min_new_tokens=2,
                                       do_sample=False, pad_token_id=0)
                    skip = len(counts)
                    if hybrid:  # (its host banks timed from here on)
                        ex.host_worker.calls = host_calls if rep >= 0 else None
                    for pi, ids in enumerate(prompts if rep >= 0 else prompts[:2]):
                        first.append(len(counts))
                        n = new_tokens if pi == 2 else 2
                        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            finally:
                stack.remove()
            if rep < 0 or hybrid:
                geom = stack.geom
                continue
            layers = float(sum(stack.geom.attn_layers) + stack.geom.tail_attn_layers)  # decoder layers
            passes = stack.cache.stats.passes
            # compute only on both sides: the measured pass minus its measured stall, against the simulated
            # pass minus its simulated stall (stalls depend on compute speed; fitting them would bias the
            # overheads)
            for i, (p, w, ws, (c, q, pl, u)) in enumerate(zip(passes, ex.pass_wall, ex.pass_stall, counts)):
                if i < skip:
                    continue
                pi = max(j for j, f in enumerate(first) if f <= i)
                key = (si, pi, i - first[pi])
                row = rows.setdefault(key, [[], [], []])
                row[0].append([layers, p.tokens * layers, p.requests, c, q, pl, u])  # equal across reps but where wall-clock
                # arrival times changed a decision (a prefetch still in flight): the median of those too
                row[1].append((w - ws) - (p.time_s - p.stall_s))
                row[2].append(w - ws)
    X = np.array([np.median(r[0], axis=0) for r in rows.values()], dtype=float)
    y = np.array([statistics.median(r[1]) for r in rows.values()])
    m = np.array([statistics.median(r[2]) for r in rows.values()])
    host = _fit_host(host_calls, geom, hw)
    # native stacks first; then the unpack term alone on the low-precision stack's residuals given those:
    # its passes vary more (unpacking differs by precision, compactions come and go) and, fitted jointly,
    # moved the token term by 3x
    # (A column scaling the roofline's share was tried: on a CPU the roofline is 1-7% of a pass and
    # collinear with the token term, and its fitted scale swung from 0.05 to 5 between runs.)
    native = np.array([not stacks[k[0]][2] for k in rows])
    coef = np.zeros(X.shape[1])
    coef[:6] = _nnls(X[native, :6] / m[native, None], y[native] / m[native])
    u, r = X[~native, 6] / m[~native], (y[~native] - X[~native, :6] @ coef[:6]) / m[~native]
    coef[6] = max(0.0, float(u @ r) / float(u @ u)) if (u > 0).any() else 0.0
    rel = (X @ coef - y) / m
    # where the model misses: the mean relative residual of the prefills per prompt size, and of the decodes
    keys = list(rows)
    by = {}
    for (si, pi, i), r in zip(keys, rel):
        by.setdefault("decode" if i else f"prefill {PROMPTS[pi]}", []).append(float(r))
    err = X @ coef - y
    report = {"relative_by_pass": {k: float(np.mean(v)) for k, v in by.items()}, "passes": len(rows),
              # the native stacks' rows (the six-term fit) and the low-precision ones' (their unpack term)
              "native_residual_rms_us": float(np.sqrt(np.mean(err[native] ** 2)) * 1e6),
              "native_mean_pass_us": float(np.mean(m[native]) * 1e6),
              "low_residual_rms_us": float(np.sqrt(np.mean(err[~native] ** 2)) * 1e6) if (~native).any() else 0.0, "reps": reps, "residual_rms_us": float(np.sqrt(np.mean((X @ coef - y) ** 2)) * 1e6),
              "relative_rms": float(np.sqrt(np.mean(rel ** 2))), "mean_pass_us": float(np.mean(m) * 1e6)}
    # (the token term per token per decoder layer: fitted per token of a pass on one depth, it did not carry to
    # a model of another: see HardwareConfig.layer_token_overhead_us)
    return {"layer_overhead_us": float(coef[0] * 1e6), "token_overhead_us": 0.0,
            "layer_token_overhead_us": float(coef[1] * 1e6),
            "expert_overhead_us": float(coef[2] * 1e6), "transfer_issue_us": float(coef[3] * 1e6),
            "predict_overhead_us": float(coef[4] * 1e6), "place_overhead_us": float(coef[5] * 1e6),
            "unpack_overhead_us": float(coef[6] * 1e6), **host}, report


def _fit_host(calls: list, geom, hw: dict) -> dict:
    """The host's per-batch, per-expert and per-token costs beyond its roofline, from the banks the host
    computed in the model's own runs ``calls`` [(experts, rows, seconds)]: non-negative least squares on
    relative error (the many one-token decode batches do not outvote the prefills'). {} without calls."""
    if not calls:
        return {}
    n = np.array([c[0] for c in calls], dtype=float)
    rows = np.array([c[1] for c in calls], dtype=float)
    t = np.array([c[2] for c in calls])
    from ..engine.clock import one_row

    host = host_roofline(hw)
    roof = np.array([host.time(2.0 * r * geom.expert_params, k * geom.expert_bytes, one_row(r, k) * geom.expert_bytes)
                     for k, r in zip(n, rows)])
    X = np.stack([np.ones_like(n), n, rows], 1)
    c = _nnls(X / t[:, None], (t - roof) / t)
    return {"host_call_overhead_us": float(c[0] * 1e6), "host_expert_overhead_us": float(c[1] * 1e6),
            "host_token_overhead_us": float(c[2] * 1e6)}


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
    from ..compose import spec_of
    from ..errors import ConfigError
    from ..hardware import HardwareConfig
    from ..hook import install
    from ..policies import REGISTRIES

    model, _ = _load(model_name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=g).to(device)
    model.to(device)

    def per_call(stack: dict) -> float:
        spec = spec_of(hardware=HardwareConfig(**hw), **stack)
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


def _model_config(model_name: str):
    from omegaconf import OmegaConf

    from .. import CONF_DIR
    from ..models.loader import ModelConfig
    from ..registry import build_params

    return build_params(ModelConfig, dict(OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / f"{model_name}.yaml"))), "model")


def _load(model_name: str):
    from ..models.loader import load_model

    mcfg = _model_config(model_name)
    return load_model(mcfg)[0], mcfg


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: SciPy's bounded solver (``lsq_linear``, trust-region
    reflective / BVLS), which replaced a search over every subset of columns (2**k - 1 unconstrained solves)."""
    from scipy.optimize import lsq_linear

    return lsq_linear(X, y, bounds=(0.0, np.inf), method="bvls").x


def _yaml(name: str, hw: dict, note: list[str]) -> str:
    lines = [f"# {line}" for line in note]
    lines.append(f"name: {name}")
    for k, v in hw.items():
        if isinstance(v, dict):
            lines.append(f"{k}:" + ("" if v else " {}"))
            lines.extend(f'  "{kk}": ' + (f"{vv:.6g}" if isinstance(vv, float) else json.dumps(vv))
                         for kk, vv in v.items())
            continue
        lines.append(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {'null' if v is None else v}")
    return "\n".join(lines) + "\n"


def check_profile(model_name: str, hw: dict, device: torch.device, prompt: int = 256, new_tokens: int = 12
                  ) -> dict:
    """calibrate's own check: the calibrated profile's simulated TTFT and TPOT against what ``execution=offload``
    measures, on two stacks at 5% (lru + topk with ``fetch``, and with ``hybrid``), a ``prompt``-token prefill
    then ``new_tokens`` greedy decodes, after a warm-up generation in the same install (as ``specmd fidelity``
    measures a cell). Returns {stack: {ttft, tpot: measured /
    simulated}}."""
    from ..compose import spec_of
    from ..executor import EXECUTION
    from ..hardware import HardwareConfig
    from ..hook import install
    from ..models.loader import local_checkpoint

    model, mcfg = _load(model_name)
    model.to(device)
    ckpt = local_checkpoint(mcfg.pretrained) if mcfg.pretrained else None
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(7)).to(device)
    out = {}
    for miss in ("fetch", "hybrid"):
        spec = spec_of(hardware=HardwareConfig(**{**hw, "capacity": 0.05}), prefetch="topk", miss=miss)
        spec.execution = EXECUTION.params({"name": "offload", "throttle": True})
        stack = install(model, spec, device=device, checkpoint=ckpt)
        try:  # a warm-up generation in the same install (first touches of the arena: specmd fidelity's cells)
            with torch.no_grad():
                for x in (torch.flip(ids[:, -32:], (1,)), ids):
                    first = len(stack.executor.pass_kinds)
                    model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0)
            ex, passes = stack.executor, stack.engine.cache.stats.passes
            ratio = {}
            for fig, kind in (("ttft", "prefill"), ("tpot", "decode")):
                rows = [(w, p.time_s) for k, w, p in zip(ex.pass_kinds[first:], ex.pass_wall[first:], passes[first:])
                        if k == kind]
                ratio[fig] = sum(r[0] for r in rows) / sum(r[1] for r in rows)
        finally:
            stack.remove()
        out[miss] = ratio
    return out


# ---- what calibrate checks before it measures, and how it writes ------------------------------------------
NAME_MAX = 100  # characters of a profile name
NAME_CHARS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # letters, digits, _ - . (not first: . -)
OVERRIDE_CHARS = "=,+~ \t[]{}()'\"$:@%*?!#&|;<>`^"  # what Hydra's override grammar (or a shell) reads as syntax


def default_name() -> str:
    """``calibrated_<host>``: the host name's first label, anything but letters, digits and _ as _."""
    host = re.sub(r"[^A-Za-z0-9_]", "_", platform.node().split(".")[0]) or "host"
    return f"calibrated_{host}"[:NAME_MAX]


def _name_problem(name: str) -> str | None:
    """What is wrong with profile name ``name`` (see :func:`check_name`), or None."""
    from .. import shipped

    if not name:
        return "a profile needs a name"
    if len(name) > NAME_MAX:
        return f"{len(name)} characters; at most {NAME_MAX}"
    if name in (".", "..") or any(c in name for c in "/\\"):
        return ("a profile name is a file name in <dir>/hardware, not a path (no / or \\, not . or ..): the "
                "profile is written to --out DIR/hardware/<name>.yaml and nowhere else")
    syntax = sorted({c for c in name if c in OVERRIDE_CHARS or c.isspace()})
    if syntax:
        return (f"{' '.join(repr(c) for c in syntax)} would break the override hardware=<name> that selects it "
                "(Hydra's override syntax)")
    if not NAME_CHARS.fullmatch(name):
        return "use letters, digits, _, - and . (not first: . or -)"
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    for where, value in ((f"Hydra reads hardware={name}", OverridesParser.create().parse_override(f"hardware={name}").value()),
                         (f"the profile's YAML reads name: {name}", OmegaConf.to_container(OmegaConf.create(f"n: {name}"))["n"])):
        if value != name or not isinstance(value, str):
            return f"{where} as {'null' if value is None else f'the {type(value).__name__} {value!r}'}, not a name"
    shipped_names = {n.lower(): n for n in shipped.options("hardware")}
    for n in (name, f"{name}_disk"):  # (<name>_disk.yaml is written beside it)
        own = shipped_names.get(n.lower())
        if own == n:
            return (f"hardware={n} selects the shipped profile specmd/conf/hardware/{own}.yaml, not the calibrated "
                    "one: specmd's own configs come first on Hydra's search path (the user config directory and "
                    "hydra.searchpath are searched after them)")
        if own:
            return (f"{n} differs from the shipped profile {own} only in case: on a case-insensitive file system "
                    f"hardware={n} selects specmd/conf/hardware/{own}.yaml (first on Hydra's search path)")
    return None


def _suggest_name(name: str) -> str:
    """A valid name close to ``name``."""
    base = re.sub(r"[^A-Za-z0-9_]+", "_", name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]).strip("_")
    if not base:
        return default_name()
    for cand in (base, f"{base}_calibrated", f"box_{base}"):
        cand = cand[:NAME_MAX]
        if cand and _name_problem(cand) is None:
            return cand
    return default_name()


def check_name(name: str) -> str:
    r"""``--name``: a file name in ``<dir>/hardware`` that ``hardware=<name>`` selects -- no path (``/``, ``\``,
    ``.``, ``..``), no override syntax (``=``, ``,``, brackets, quotes, spaces ...), letters, digits, ``_``,
    ``-`` and ``.`` (not first: ``.`` or ``-``), at most :data:`NAME_MAX` characters, read back by Hydra as
    that same string (not ``null``, ``true``, ``1.5``), and not a shipped profile's name (nor ``<name>_disk``):
    specmd's configs come first on Hydra's search path, so ``hardware=a100_pcie`` would select the shipped
    profile, not the calibrated one. Returns ``name``; a ConfigError names the problem and a name that works."""
    from ..errors import ConfigError

    problem = _name_problem(name)
    if problem:
        raise ConfigError(f"--name {name!r}: {problem}; e.g. --name {_suggest_name(name)}")
    return name


def check_output(out: str | None, name: str) -> Path:
    """Where the profiles go: ``<DIR>/hardware`` of ``--out DIR`` (default: the user config directory),
    checked before any measurement -- a directory (or one that can be created: no file in its path), writable,
    and ``<name>.yaml`` / ``<name>_disk.yaml`` inside it and not directories. Returns the absolute hardware
    directory (not created)."""
    from .. import user_config_dir
    from ..errors import ConfigError

    if out is not None and not out.strip():
        raise ConfigError(f"--out {out!r}: an empty path; name a directory (default: the user config directory)")
    root = Path(out).expanduser() if out is not None else Path(user_config_dir())
    flag = f"--out {out}" if out is not None else f"the user config directory {root} ($SPECMD_CONFIG)"
    hw_dir = Path(os.path.abspath(root / "hardware"))
    writable_dir(hw_dir, flag)
    for n in (name, f"{name}_disk"):
        target = hw_dir / f"{n}.yaml"
        if not _inside(target, hw_dir):
            raise ConfigError(f"--name {name!r}: {target} is not inside {hw_dir}")
        if os.path.lexists(target) and (target.is_dir() or not target.is_file()):
            raise ConfigError(f"{flag}: {target} exists and is not a file (the profile would replace it)")
    return hw_dir


def _inside(path: Path, directory: Path) -> bool:
    """``path`` lies directly in ``directory`` once both are resolved (its own last component is not followed:
    os.replace replaces a link, not what it points to)."""
    d = Path(os.path.realpath(directory))
    return Path(os.path.realpath(path.parent)) == d and path.name not in ("", ".", "..")


def check_model(model: str) -> None:
    """``--model`` names a shipped model config whose checkpoint this machine can load: a local or shipped
    checkpoint, or a hub id the hub (or the local HF cache) answers -- checked before any measurement (offline,
    a hub model used to fail after the link and compute measurements, with a traceback). ConfigError for an
    unknown config or a missing shipped checkpoint, DataError for an unreachable hub."""
    from .. import shipped
    from ..errors import ConfigError

    models = shipped.options("model")
    if model not in models:  # --quick never loads it: checked here, not after minutes of fitting
        raise ConfigError(f"--model {model!r}: no such model config; valid choices: {', '.join(models)}")
    mcfg = _model_config(model)
    if mcfg.pretrained:
        from ..eval.mirror import require_hub_for
        from ..models.loader import resolve_pretrained

        path = resolve_pretrained(mcfg.pretrained)  # (a missing shipped checkpoint: ConfigError)
        if not os.path.isdir(os.path.expanduser(path)):
            require_hub_for(f"--model {model} (model.pretrained={mcfg.pretrained})", path)


def _write_fd(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, then fsync."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _write_atomic(files: list[tuple[Path, str | bytes]], keep: bool = True) -> None:
    """Each ``(path, content)`` written in full to a temporary file in the path's own directory
    (``.<name>.<random>.tmp``: no config group option, no half file under the real name), then all renamed
    into place (os.replace) with signals held: an interrupt (:class:`~specmd.signals.Interrupted`) or an error
    at any point leaves every path as it was before (or, once renamed, all complete) and no temporary file. A
    write the disk or a permission refused names the file, and (``keep``) what was not written is kept
    elsewhere (:func:`_kept_elsewhere`)."""
    import secrets

    from ..signals import check_interrupt, signals_held

    temps: list[tuple[Path | None, Path]] = []
    path = files[0][0] if files else Path(".")
    try:
        for path, content in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
            with signals_held():  # (recorded as soon as it exists: an interrupt cannot strike in between)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                temps.append((tmp, path))
            check_interrupt()
            try:
                _write_fd(fd, content.encode() if isinstance(content, str) else content)
            finally:
                os.close(fd)
        with signals_held():  # all renamed, or (an error) the rest removed as temporaries
            for i, (tmp, path) in enumerate(temps):
                os.replace(tmp, path)
                temps[i] = (None, path)
    except BaseException as exc:
        with signals_held():  # a second Ctrl-C cannot leave a temporary file behind
            for tmp, _ in temps:
                if tmp is not None:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
        unwritten = [f for i, f in enumerate(files) if i >= len(temps) or temps[i][0] is not None]
        if keep and isinstance(exc, OSError) and exc.errno in FULL_ERRNOS | PATH_ERRNOS and unwritten:
            raise _kept_elsewhere(exc, unwritten, path) from exc  # what no path took is kept elsewhere, and named
        raise
    check_interrupt()  # a signal that arrived while held: raised now, the files complete


def _kept_elsewhere(exc: OSError, files: list, path: Path) -> OSError:
    """A write of ``files`` that failed at ``path`` (a full disk, a read-only directory): the error naming it,
    with every file's content kept under ``<tmp>/specmd-rescue/`` (the profile calibrate measured for minutes
    is not lost with the disk) and named."""
    from ..results import keep_elsewhere, rescue_dir

    kept = [keep_elsewhere(p, lambda tmp, c=c: Path(tmp).write_bytes(c.encode() if isinstance(c, str) else c))
            for p, c in files]
    phrases = [k[1] for k in kept]
    if len(kept) > 1 and all(k[0] is not None for k in kept) and len({p.parent for p, _ in files}) == 1:
        phrases = [f"what calibrate measured is kept in {rescue_dir(path.parent)}/ ("
                   f"{', '.join(p.name for p, _ in files)})"]
    return OSError(exc.errno, f"{exc.strerror or exc}; " + "; ".join(phrases), str(path))


def use_command(name: str, out_root: Path | None) -> str:
    """The run's overrides that select profile ``name``, quoted for a shell and for Hydra's override grammar:
    ``hardware=<name>``, and ``hydra.searchpath=[file://DIR]`` for a profile written with ``--out DIR``."""
    if out_root is None:
        return f"hardware={name}"
    url = f"file://{Path(os.path.abspath(out_root))}"
    if not re.fullmatch(r"[A-Za-z0-9_./:-]+", url):  # Hydra: a quoted string (a quote escaped with \, and
        # backslashes only where they precede a quote or the end), the whole override quoted for the shell
        url = '"' + re.sub(r'(\\*)("|$)', lambda m: m[1] * 2 + ('\\"' if m[2] else ""), url) + '"'
    return f"hardware={name} " + shlex.quote(f"hydra.searchpath=[{url}]")


def _disk_probe() -> Path:
    from ..quant.base import cache_dir

    return cache_dir().parent / "calibrate" / "disk-probe.bin"


def prepare(out: str | None, name: str | None, model: str, device: str) -> tuple[str, Path]:
    """Everything calibrate checks before it measures (minutes of it): the device, the profile name
    (:func:`check_name`; default :func:`default_name`), the output directory (:func:`check_output`), the
    disk probe's directory, and the model (:func:`check_model`). Returns (name, hardware directory);
    ConfigError (bad input) or DataError (an unreachable hub) otherwise."""
    from ..app import check_device

    check_device(device)
    name = check_name(default_name() if name is None else name)
    hw_dir = check_output(out, name)
    writable_dir(_disk_probe().parent, "the disk probe's directory ($SPECMD_CACHE)")
    check_model(model)
    return name, hw_dir


def calibrate(out: str | None = None, name: str | None = None, model: str = "deep_olmoe", device: str = "cpu",
              quick: bool = False, log=print, remeasure: bool = False) -> dict:
    """Measure this machine and write ``<out or the user config directory>/hardware/<name>.yaml`` (and
    ``<name>_disk.yaml``); see the module's doc. Its arguments are checked first (:func:`prepare`)."""
    name, hw_dir = prepare(out, name, model, device)
    return _calibrate(hw_dir, name, out is not None, model, device, quick, log, remeasure)


MEASURE_VERSION = 4  # bump when a measurement changes meaning: older saved measurements are not reused


def measurement_key(model: str, device: str) -> dict:
    """What a saved measurement is valid for: this host, device, torch, the model it was fitted on, and the
    version of the measurements."""
    return {"host": platform.node(), "device": str(device), "torch": torch.__version__, "model": model,
            "version": MEASURE_VERSION}


class Measurements:
    """calibrate's measurements, each stage saved as it completes (``$SPECMD_CACHE/../calibrate/<key>.json``,
    atomically) and reused by a later calibrate of the same :func:`measurement_key` unless ``remeasure``:
    a second calibrate (another name, ``--out``) takes seconds, and an interrupted one resumes at the stage
    it was in."""

    def __init__(self, key: dict, remeasure: bool):
        import hashlib

        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = _disk_probe().parent / f"measured-{digest}.json"
        self.key, self.reused = key, []
        self.data = {}
        if not remeasure and self.path.is_file():
            try:
                saved = json.loads(self.path.read_text())
                if saved.get("key") == key:
                    self.data = saved.get("stages", {})
            except (OSError, ValueError):
                self.data = {}

    def stage(self, name: str, fn):
        """The saved result of stage ``name``, or ``fn()``'s, saved."""
        if name in self.data:
            self.reused.append(name)
            return self.data[name]
        value = fn()
        from ..results import write_json_atomic

        self.data[name] = json.loads(json.dumps(value))  # (as read back: tuples as lists)
        write_json_atomic(self.path, {"key": self.key, "stages": self.data})
        return self.data[name]


def _small_fields(report: dict) -> dict:
    """A link fit's small-copy regime as the profile's fields (:func:`_fit_link`; null: one rate)."""
    small = report.get("small_bw")
    return {"small_copy_gbps": small / 1e9 if small else None,
            "small_copy_mb": report["small_bytes"] / 1e6 if small else None}


def _small(report: dict) -> str:
    f = _small_fields(report)
    return f" ({f['small_copy_gbps']:.3g} GB/s up to {f['small_copy_mb']:.3g} MB)" if f["small_copy_gbps"] else ""


def _calibrate(hw_dir: Path, name: str, out: bool, model: str, device: str, quick: bool, log,
               remeasure: bool = False) -> dict:
    from ..errors import ConfigError
    from ..executor.base import steady_host_allocator

    t_start = time.perf_counter()
    say = log
    log = lambda m: say(f"{m}  [{time.perf_counter() - t_start:.0f} s]")  # noqa: E731 (each stage's time)
    steady_host_allocator()  # as execution=offload measures: the fit and the runs it predicts see the same heap
    dev = torch.device(device)
    ms = Measurements(measurement_key(model, device), remeasure)
    log(f"specmd calibrate: measuring {platform.node()} ({dev}) ..."
        + (f" (reusing measurements of an earlier calibrate: {ms.path}; --remeasure measures anew)" if ms.data else ""))

    def link():
        rep = {}
        bw, lat = measure_ram_link(dev, report=rep)
        return {"bw": bw, "lat": lat, "report": rep}

    def disk():
        rep = {}
        bw, lat = measure_disk_link(dev, _disk_probe(), report=rep)
        return {"bw": bw, "lat": lat, "report": rep}

    def compute():
        flops, mem, kern = measure_compute(dev)
        hflops, hmem, hkern = (flops, mem, kern) if dev.type == "cpu" else measure_compute(torch.device("cpu"))
        return {"flops": flops, "mem": mem, "kernel": kern, "hflops": hflops, "hmem": hmem, "host_kernel": hkern}

    ln, dk, cp = ms.stage("link", link), ms.stage("disk", disk), ms.stage("compute", compute)
    log(f"  link (host memory -> {dev}): {ln['bw'] / 1e9:.3g} GB/s{_small(ln['report'])}, latency {ln['lat'] * 1e6:.3g} "
        f"us (fit: median error {ln['report']['median_abs_err']:.1%}, worst {ln['report']['max_abs_err']:.1%})")
    log(f"  link (disk, page cache dropped -> host): {dk['bw'] / 1e9:.3g} GB/s{_small(dk['report'])}, latency "
        f"{dk['lat'] * 1e6:.3g} us")
    kern = cp["kernel"]
    log(f"  compute (the experts' kernel, {len(kern['points'])} shapes): {cp['flops'] / 1e12:.3g} TFLOP/s, weights "
        f"read at {cp['mem'] / 1e9:.3g} GB/s (one row: {kern['gemv_bw'] / 1e9:.3g}), serial {kern['serial']:.2f} "
        f"(fit: median error "
        f"{kern['median_abs_err']:.1%}, worst {kern['max_abs_err']:.1%})"
        + (f"; host {cp['hflops'] / 1e12:.3g} TFLOP/s, {cp['hmem'] / 1e9:.3g} GB/s" if dev.type != "cpu" else ""))
    hw = {"capacity": 0.05, "experts_per_layer": None, "scope": "global", "bandwidth_gbps": ln["bw"] / 1e9,
          "latency_us": ln["lat"] * 1e6, "peak_tflops": cp["flops"] / 1e12, "mem_bandwidth_gbps": cp["mem"] / 1e9,
          "host_tflops": cp["hflops"] / 1e12, "host_mem_bandwidth_gbps": cp["hmem"] / 1e9,
          "roofline_serial": kern["serial"], "host_roofline_serial": cp["host_kernel"]["serial"],
          "gemv_bandwidth_gbps": kern["gemv_bw"] / 1e9, "host_gemv_bandwidth_gbps": cp["host_kernel"]["gemv_bw"] / 1e9,
          **_small_fields(ln["report"]), "timing_as": None,
          # a GPU queues kernels ahead of the device: the host's overheads overlap its compute (SimClock)
          "host_overlap": dev.type == "cuda"}
    cont = ms.stage("contention", lambda: measure_contention(dev, hw))
    hw["host_link_contention"] = cont[0]
    log(f"  contention (host experts and copies at once): {cont[0]:.2f} of the overlap (host alone "
        f"{cont[1]['host_ms']:.2f} ms, copies alone {cont[1]['link_ms']:.2f} ms, together {cont[1]['together_ms']:.2f} ms)")

    def host_experts():
        loaded, mcfg = _load(model)
        return measure_host_experts(loaded, mcfg.family, hw, dev)

    host, cases = ms.stage("host_experts", host_experts)
    hw.update(host)
    log(f"  host experts ({model}, {'on the host worker' if dev.type == 'cuda' else 'inline'}): {host['host_call_overhead_us']:.3g} us per batch + "
        f"{host['host_expert_overhead_us']:.3g} us per expert + {host['host_token_overhead_us']:.3g} us per token "
        f"beyond the roofline (measured: " + ", ".join(f"{k} {v:.0f} us" for k, v in cases.items()) + ")")
    fit = {}
    if quick:
        log("  --quick: skipped the policies' decision costs, the overhead fit and the check (the simulated clock "
            "then leaves out the framework's per-layer, per-token and per-expert costs)")
    else:
        # policies first: the fit's low-precision stack (miss=fetch_priority) is then simulated with its
        # decision cost, and the unpack term is what is left
        costs, skipped = ms.stage("policies", lambda: measure_policies(model, hw, dev, log=log))
        hw["policy_overhead_us"] = costs
        # (fitted as costs that add to compute; on a GPU the clock overlaps them with the device's compute per
        # segment between synchronisations: the tiny fit model's device time is ~0, where the two agree)
        over, fit = ms.stage("overheads", lambda: fit_overheads(model, dict(hw, host_overlap=False), dev))
        fit["policies_not_measured"] = skipped
        hw.update(over)
        if "host_call_overhead_us" in over:
            log(f"  host experts in the model's runs (miss=hybrid): {over['host_call_overhead_us']:.3g} us per batch + "
                f"{over['host_expert_overhead_us']:.3g} us per expert + {over['host_token_overhead_us']:.3g} us per "
                f"token (these replace the ones above)")
        log(f"  overheads ({model}, {fit['passes']} passes): decoder layer {over['layer_overhead_us']:.4g} us, token "
            f"x layer {over['layer_token_overhead_us']:.4g} us, expert {over['expert_overhead_us']:.4g} us, transfer issue "
            f"{over['transfer_issue_us']:.4g} us, expert placed {over['place_overhead_us']:.4g} us, prediction "
            f"{over['predict_overhead_us']:.4g} us, unpacking a "
            f"low-precision expert {over['unpack_overhead_us']:.4g} us")
        log(f"  fit: residual rms {fit['native_residual_rms_us']:.3g} us of a {fit['native_mean_pass_us']:.4g} us mean "
            f"pass ({fit['native_residual_rms_us'] / fit['native_mean_pass_us']:.1%}) on the native stacks, "
            f"{fit['low_residual_rms_us']:.3g} us on the low-precision ones (all: "
            f"{fit['residual_rms_us'] / fit['mean_pass_us']:.1%}), relative rms {fit['relative_rms']:.1%}; mean "
            f"relative error " + ", ".join(f"{k} {v:+.1%}" for k, v in fit["relative_by_pass"].items()))
    if ms.reused:
        log(f"  reused from an earlier calibrate: {', '.join(ms.reused)}")
    geom = _geometry(model)
    hw["calibrated_on"] = {"host": platform.node(), "device": str(dev), "torch": torch.__version__,
                           "dtype": geom["dtype"], "model": model, "expert_bytes": geom["expert_bytes"],
                           "kernel_bytes": [min(p["bytes"] for p in kern["points"]),
                                            max(p["bytes"] for p in kern["points"])],
                           # the machine's speed as the profile was fitted (not saved with the measurements:
                           # a reused stage was measured then, the probe says now)
                           "speed": speed_probe(dev)}
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    note = [f"specmd calibrate, {stamp}, on {platform.node()} ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores), device {dev}, torch {torch.__version__}",
            f"overheads fitted on model={model}" if fit else "overheads not fitted (--quick)"]
    note += [f"policy_overhead_us: {k} not measured ({why})" for k, why in fit.get("policies_not_measured", {}).items()]
    path, path_disk = hw_dir / f"{name}.yaml", hw_dir / f"{name}_disk.yaml"
    for p in (path, path_disk):  # (checked before measuring; asserted again where it is written)
        if not _inside(p, hw_dir):
            raise ConfigError(f"--name {name!r}: {p} is not inside {hw_dir}")
    disk = dict(hw, bandwidth_gbps=dk["bw"] / 1e9, latency_us=dk["lat"] * 1e6, **_small_fields(dk["report"]))
    # both complete or neither: an interrupted calibrate leaves no half profile for hardware=<name> to find
    _write_atomic([(path, _yaml(name, hw, note + ["link: host memory (execution.host=ram)"])),
                   (path_disk, _yaml(f"{name}_disk", disk,
                                     note + ["link: the disk, page cache dropped (execution.host=disk)"]))])
    check = {}
    if not quick:
        check = check_profile(model, hw, dev)
        log("  check (measured / simulated with this profile, 5%, lru + topk, 256-token prompt + 12 decodes): "
            + "; ".join(f"miss={k}: TTFT {v['ttft']:.2f}, TPOT {v['tpot']:.2f}" for k, v in check.items()))
    use = use_command(name, hw_dir.parent if out else None)
    log(f"wrote {path} and {path_disk} in {time.perf_counter() - t_start:.0f} s\n"
        f"how far to trust it: specmd fidelity --profile {shlex.quote(str(path))}\n"
        f"use: python -m specmd execution=offload {use}")
    components = {"link": ln["report"], "disk": dk["report"], "kernel": kern, "host_kernel": cp["host_kernel"],
                  "contention": cont[1]}
    return {"path": str(path), "path_disk": str(path_disk), "hardware": hw, "fit": fit, "name": name, "check": check,
            "components": components, "reused": ms.reused}


def _geometry(model: str) -> dict:
    """The model config's dtype and expert bytes (its geometry; no weights loaded)."""
    from ..models.loader import model_geometry

    cfg = _model_config(model)
    return {"dtype": str(cfg.dtype), "expert_bytes": int(model_geometry(cfg).expert_bytes)}


def main(argv=None) -> int:
    from ..errors import ArgumentParser

    ap = ArgumentParser(prog="specmd calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write DIR/hardware/<name>.yaml (default: the user config directory, on "
                                  "Hydra's search path)")
    ap.add_argument("--name", help="profile name (default: calibrated_<host>)")
    ap.add_argument("--model", default="deep_olmoe", help="model config the overheads are fitted on")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="link, compute and host experts only (no policy costs, "
                                                           "overhead fit or check)")
    ap.add_argument("--remeasure", action="store_true", help="measure everything anew (default: reuse what an "
                                                               "earlier calibrate of this host, device, torch and "
                                                               "model measured)")
    a = ap.parse_args(argv)
    # before any measurement; bad input (ConfigError, DataError) is one line and exit 2: specmd.outcome
    name, hw_dir = prepare(a.out, a.name, a.model, a.device)
    _calibrate(hw_dir, name, a.out is not None, a.model, a.device, a.quick, print, a.remeasure)
    return 0
